"""Structured outputs: the output follows its JSON schema, regex, choice or grammar; greedy, it is transformers'
argmax over the tokens the grammar allows, alone or in any batch mix."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import make_engine

from loom import LLM, SamplingParams, StructuredOutputParams
from loom.structured_output import GrammarCompiler, forbidden_tokens

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                          "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
CONSTRAINTS = [
    StructuredOutputParams(regex=r"[a-z]{3}-[0-9]{2}"),
    StructuredOutputParams(choice=["quick brown fox", "lazy dog", "Paris"]),
    StructuredOutputParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputParams(grammar='root ::= ("yes" | "no") " because " [a-z] [a-z]? [a-z]? "."'),  # llama.cpp's GBNF
    StructuredOutputParams(grammar='start: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9][0-9]?/'),  # Lark
]


def follows(constraint: StructuredOutputParams, text: str) -> bool:
    """Whether `text` is a whole sentence of the constraint, checked without llguidance."""
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    if constraint.json is not None:
        value = json.loads(text)
        return (set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
                and re.fullmatch("[a-z]{2,4}", value["tag"]) is not None)
    if "because" in constraint.grammar:
        return re.fullmatch(r"(yes|no) because [a-z]{1,3}\.", text) is not None
    return re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text) is not None


def hf_constrained_greedy(hf, compiler: GrammarCompiler, prompt: list[int], constraint: StructuredOutputParams,
                          max_tokens: int) -> list[int]:
    """transformers' logits, the grammar's disallowed tokens masked, argmax: token by token, one prompt alone."""
    matcher = compiler.compile(constraint)
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = hf(torch.tensor([ids])).logits[0, -1:]
            logits = logits.masked_fill(forbidden_tokens([matcher], logits.shape[1]), float("-inf"))
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            matcher.accept(token)
            if token == 0 or matcher.is_complete:
                break
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tiny_llama):
    """(prompt, constraint, transformers' constrained greedy tokens) for every constraint and two prompts."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    compiler = GrammarCompiler(tiny_llama.tokenizer, tiny_llama.config.vocab_size)
    prompts = [tiny_llama.tokenizer.encode("The quick brown fox"), list(range(30, 70))]
    return [(p, c, hf_constrained_greedy(hf, compiler, p, c, 40)) for c in CONSTRAINTS for p in prompts]


def test_greedy_constrained_outputs_equal_transformers_masked_argmax(tiny_llama, reference):
    llm = LLM(dtype="float32", loaded=tiny_llama, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=128, block_size=8)
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=c) for _, c, _ in reference]
    outs = llm.generate([p for p, _, _ in reference], params)
    for out, (_, constraint, expected) in zip(outs, reference):
        assert out.token_ids == expected
        assert out.finish_reason == "stop" and follows(constraint, out.text), (constraint, out.text)
    unconstrained = llm.generate([p for p, _, _ in reference[:2]], SamplingParams(max_tokens=12, temperature=0.0))
    assert not any(re.fullmatch(CONSTRAINTS[0].regex, o.text) for o in unconstrained), "the grammar must matter"


def test_constrained_requests_in_any_batch_mix_equal_alone(tiny_llama, reference):
    """Constrained and plain requests mixed, with chunked prompts and few blocks (preemption), as each one alone."""
    plain = [([7, 8, 9] * 5, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
             (list(range(100, 160)), SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True))]
    work = [(p, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=c)) for p, c, _ in reference] + plain
    alone = []
    for prompt, params in work:
        engine = make_engine(tiny_llama, max_num_seqs=1)
        engine.add_request(prompt, params)
        alone.append(next(iter(engine.run_to_completion().values())).token_ids)
    engine = make_engine(tiny_llama, max_num_seqs=6, budget=24, blocks=40)
    preempted = []
    engine.step_observers.append(lambda out, *_: preempted.extend(out.preempted))
    ids = [engine.add_request(prompt, params, request_id=str(i)) for i, (prompt, params) in enumerate(work)]
    finished = engine.run_to_completion()
    assert [finished[i].token_ids for i in ids] == alone
    assert preempted, "the cache must be small enough to preempt"
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_sampled_outputs_follow_their_constraint(tiny_llama):
    llm = LLM(dtype="float32", loaded=tiny_llama, max_num_seqs=8, num_kv_blocks=128, block_size=8)
    params = [SamplingParams(max_tokens=60, temperature=1.5, seed=seed, structured_outputs=c)
              for c in CONSTRAINTS for seed in range(4)]
    outs = llm.generate(["Once upon a time"] * len(params), params)
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop" and follows(p.structured_outputs, out.text), (p.structured_outputs, out.text)
    assert len({o.text for o in outs}) > len(CONSTRAINTS), "sampling must vary within a constraint"


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "JSON object"),
    ({"choice": []}, "choice"),
    ({"regex": ""}, "regex"),
    ({"json_object": "yes"}, "exactly one"),
])
def test_bad_constraints_raise_value_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputParams(**kwargs)


@pytest.mark.parametrize("constraint, needle", [
    (StructuredOutputParams(regex="[a-z"), "unclosed character class"),
    (StructuredOutputParams(json={"type": "objectx"}), "objectx"),
    (StructuredOutputParams(grammar="root ::= (("), "grammar"),
])
def test_constraints_that_do_not_compile_fail_at_create_request(tiny_llama, constraint, needle):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match=needle):
        engine.add_request([5, 6], SamplingParams(structured_outputs=constraint))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputParams(regex="a+"))
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_smollm2_answers_a_json_schema_in_bfloat16(smollm2):
    """The bundled model, asked for a person as JSON, fills the schema (flexible whitespace allowed)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    llm = LLM(loaded=smollm2, dtype="bfloat16", max_num_seqs=2)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give me a JSON object for a person called Ann who is 31."}])
    out = llm.generate(prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                              structured_outputs=StructuredOutputParams(json=schema)))[0]
    assert out.finish_reason == "stop"
    assert json.loads(out.text) == {"name": "Ann", "age": 31}
