"""KV cache groups: sliding-window layers give back the blocks their window left behind, the prefix cache reuses a
prefix only where every group still holds what comes after it, and outputs stay those of transformers."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import _save_tiny, alone_runner, drive, greedy, hf_greedy, make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import LLM
from loom.engine.kv_cache import NULL_BLOCK, BlockPool, KVCacheSpec, block_hashes
from loom.engine.kv_manager import FullAttentionBlocks, KVCacheManager, SlidingWindowBlocks
from loom.engine.request import Request
from loom.model.config import KVCacheGroup, ModelConfig
from loom.model.loader import load_model
from loom.sampling import SamplingParams


def test_layers_form_groups_of_one_kind_and_one_size():
    gemma = ModelConfig("gemma3", 10, 8, 18, 4, 1, 256, 8, 100, sliding_window=512,
                        sliding_layers=[(i + 1) % 6 != 0 for i in range(18)])
    groups = gemma.kv_cache_groups
    assert groups[0] == KVCacheGroup((5, 11, 17), None)
    assert [g.window for g in groups[1:]] == [512] * 5 and all(len(g.layers) == 3 for g in groups)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))
    llama = ModelConfig("llama", 10, 8, 4, 4, 1, 256, 8, 100)
    assert llama.kv_cache_groups == [KVCacheGroup((0, 1, 2, 3), None)]


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(st.booleans(), min_size=1, max_size=24), window=st.integers(1, 20),
       block_size=st.sampled_from([1, 2, 4, 8]), limit=st.integers(0, 24))
def test_longest_hit_is_the_longest_prefix_whose_reachable_blocks_are_cached(cached, window, block_size, limit):
    """Against the definition: a hit of n blocks resumes at position n * block_size, whose queries read keys from
    n * block_size - window + 1 on; every block holding such a key must be cached (full attention: all of them)."""
    keys = list(range(100, 100 + len(cached)))
    limit = min(limit, len(keys))
    pool = BlockPool(2 * len(keys) + 1)
    full, sliding = FullAttentionBlocks(pool, block_size, 0), SlidingWindowBlocks(pool, block_size, 1, window)
    for group in (full, sliding):
        for key, block, is_cached in zip(keys, pool.allocate(len(keys)), cached):
            if is_cached:
                pool.cache_block(block, group._key(key))
    first_key = [max(0, n * block_size - window + 1) for n in range(limit + 1)]
    assert sliding.longest_hit(keys, limit) == max(
        n for n in range(limit + 1) if all(cached[first_key[n] // block_size : n]))
    assert full.longest_hit(keys, limit) == max(n for n in range(limit + 1) if all(cached[:n]))


def test_a_cached_prefix_needs_only_the_blocks_its_window_reaches():
    """Blocks of 4, window 6. A 41-token request prefilled in chunks of 8 ends holding every block in the full
    group but only its last three in the sliding group; a request with the same prefix then takes all 10 full
    blocks, and in the sliding group only blocks 8 and 9 (its next query, at position 40, reads keys 35-40)."""
    pool = BlockPool(23)  # 22 usable: 11 blocks in each group
    kv = KVCacheManager(pool, 4, [KVCacheGroup((0,), None), KVCacheGroup((1,), 6)])
    first = Request("a", list(range(41)), SamplingParams(), 0.0)
    for computed in range(0, 41, 8):
        first.num_computed_tokens = computed
        assert kv.allocate(first, min(41, computed + 8))
        first.num_computed_tokens = min(41, computed + 8)
        kv.cache_computed(first)
    full_table, sliding_table = kv.block_tables(first)
    assert len(full_table) == 11 and NULL_BLOCK not in full_table
    assert sliding_table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in sliding_table[8:]
    assert pool.num_used_blocks == 11 + 3
    kv.free(first)
    assert pool.num_free_blocks == pool.num_usable_blocks
    pool.check_invariants()

    second = Request("b", list(range(41)) + [7], SamplingParams(), 0.0)
    assert kv.take_cached_prefix(second) == 10 and second.num_computed_tokens == 40
    full_table, sliding_table = kv.block_tables(second)
    assert NULL_BLOCK not in full_table and sliding_table[:8] == [NULL_BLOCK] * 8 and len(sliding_table) == 10
    assert pool.num_used_blocks == 10 + 2
    kv.free(second)
    pool.check_invariants()


@pytest.mark.parametrize(("sliding_cached", "hit"), [((0, 1, 2, 5, 6, 7, 8, 9), 7), ((0, 1, 2, 5, 7, 8, 9), 3)])
def test_a_hit_is_shortened_until_every_group_can_serve_it(sliding_cached, hit):
    """The full group holds blocks 0-6 (a hit of at most 7). With blocks of 4 and a window of 6, a hit of n needs
    the sliding group's blocks (4n - 5) // 4 to n - 1: at 7 blocks 5-6. Without block 6, 7, 6, 5 and 4 miss (they
    need 5-6, 4-5, 3-4, 2-3) and 3 is the longest hit (blocks 1-2)."""
    pool = BlockPool(40)
    kv = KVCacheManager(pool, 4, [KVCacheGroup((0,), None), KVCacheGroup((1,), 6)])
    keys = block_hashes(list(range(41)), 4)
    for index in range(7):
        pool.cache_block(pool.allocate(1)[0], (0, keys[index]))
    for index in sliding_cached:
        pool.cache_block(pool.allocate(1)[0], (1, keys[index]))
    request = Request("r", list(range(41)) + [1], SamplingParams(), 0.0)
    assert kv.take_cached_prefix(request) == hit and request.num_computed_tokens == 4 * hit
    assert sum(b != NULL_BLOCK for b in kv.block_tables(request)[1]) == min(hit, 2)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    return _save_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3-kv"))


def test_local_layers_give_blocks_back_and_a_long_request_stays_bounded(tiny_gemma3_dir):
    """Tiny Gemma 3: layers [local, global, local], window 6, blocks of 4: one full group and two sliding groups.
    A 200-token request holds 50 blocks in the full group, but in a sliding group only the blocks of its chunk and
    the 5 keys before it: a chunk of 8 at position s (a multiple of 8) spans blocks (s - 5) // 4 to (s + 7) // 4,
    4 blocks (the admission bound, (8 + 6 - 1) / 4 + 1, is 5). One table for every layer would hold 150 blocks."""
    import transformers

    loaded = load_model(tiny_gemma3_dir)
    llm = LLM(dtype="float32", loaded=loaded, max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=80,
              block_size=4)
    engine = llm.engine
    held: list[tuple[int, ...]] = []

    def observe(*_):
        engine.pool.check_invariants()
        for r in engine.scheduler.running:
            held.append(tuple(sum(b != NULL_BLOCK for b in t) for t in engine.kv.block_tables(r)))
            assert engine.pool.num_used_blocks == sum(held[-1])

    engine.step_observers.append(observe)
    prompt = [random.Random(3).randrange(5, 320) for _ in range(160)]
    out = llm.generate([prompt], greedy(40))[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    assert out == hf_greedy(hf, prompt, 40, eos_token_id=None)
    assert max(h[0] for h in held) == 50 and max(max(h[1:]) for h in held) == 4
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks  # 80 blocks: 150 would not have fit


@pytest.mark.parametrize("num_kv_blocks", [300, 60])
def test_prefix_caching_across_windows_changes_no_output(tiny_gemma3_dir, num_kv_blocks):
    """Requests share 30- and 41-token prefixes (longer than the window): later ones take cached blocks in every
    group, in the sliding groups only the last ones, and every output equals the run without a prefix cache.
    With 300 blocks nothing is evicted and each of the 6 later requests takes its whole prefix (7 or 10 blocks);
    with 60, LRU evicts the sliding groups' prefix blocks first (they went back while their request still ran),
    so most requests find the full group's blocks but not the window's, and take nothing."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(5, 320) for _ in range(n)] for n in (30, 41)]
    prompts = [prefixes[i % 2] + [rng.randrange(5, 320) for _ in range(rng.randint(0, 5))] for i in range(8)]
    outputs, hits = {}, {}
    for caching in (False, True):
        llm = LLM(dtype="float32", loaded=load_model(tiny_gemma3_dir), max_num_seqs=3, max_num_batched_tokens=16,
                  num_kv_blocks=num_kv_blocks, block_size=4, enable_prefix_caching=caching)
        llm.engine.step_observers.append(lambda *_: llm.engine.pool.check_invariants())
        outputs[caching] = [o.token_ids for o in llm.generate(prompts, greedy(12))]
        hits[caching] = llm.engine.scheduler.prefix_cache_hits
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_usable_blocks
    assert outputs[True] == outputs[False]
    assert hits[False] == 0 and hits[True] == (3 * 7 * 4 + 3 * 10 * 4 if num_kv_blocks == 300 else 7 * 4)


def test_kv_footprint_figure_counts_what_the_request_held(tiny_gemma3_dir, tiny_llama):
    """Tiny Gemma 3, blocks of 4, window 6, budget 16: a 100-token request (98 prompt tokens, 2 sampled) holds in
    its decode step 25 full-group blocks and in each sliding group the 2 blocks that hold positions 93-98; one table
    for every layer would hold 3 x 25. A model with one kind of layer holds exactly one table."""
    from loom.bench.perf import kv_footprint

    gemma = LLM(dtype="float32", loaded=load_model(tiny_gemma3_dir), max_num_batched_tokens=16, num_kv_blocks=200,
                block_size=4).engine
    figure = kv_footprint(gemma, 100)
    assert figure["kv_groups"] == [None, 6, 6]
    assert figure["one_table_blocks"] == 75 and figure["decode_blocks"] == 25 + 2 * 2
    assert figure["decode_fraction_of_one_table"] == round(29 / 75, 3)
    # The largest step: the chunk of positions 80-95, which reaches back to 75, so blocks 18-23 in each sliding
    # group, while the full group holds blocks 0-23.
    assert figure["peak_blocks"] == 24 + 2 * 6
    block_mib = gemma.runner.kv_spec.bytes_per_block / (1 << 20)
    assert figure["one_table_kv_mib"] == round(75 * block_mib, 2)
    llama = LLM(dtype="float32", loaded=tiny_llama, max_num_batched_tokens=16, num_kv_blocks=200, block_size=4).engine
    assert kv_footprint(llama, 100)["decode_fraction_of_one_table"] == 1.0


@pytest.fixture(scope="module")
def tiny_gemma3(tiny_gemma3_dir):
    return load_model(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def gemma_alone(tiny_gemma3):
    return alone_runner(tiny_gemma3, blocks=200)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), max_num_seqs=st.integers(1, 5), budget=st.integers(8, 48),
       blocks=st.integers(20, 90), block_size=st.sampled_from([1, 2, 4, 8]), caching=st.booleans())
def test_windowed_groups_change_no_output_under_random_mixes(tiny_gemma3, gemma_alone, seed, max_num_seqs, budget,
                                                             blocks, block_size, caching):
    """Shared prefixes longer than the window, random arrivals, pools small enough to preempt and evict: every
    output equals the request run alone, the pool is whole after every step and full at the end."""
    rng = random.Random(seed)
    vocab = tiny_gemma3.config.vocab_size
    prefixes = [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 30))] for _ in range(2)]
    workload = [(rng.choice(prefixes) + [rng.randrange(5, vocab) for _ in range(rng.randint(0, 8))],
                 rng.randint(1, 16)) for _ in range(rng.randint(2, 8))]
    longest = max(len(p) + n for p, n in workload)
    blocks = max(blocks, 3 * -(-longest // block_size) + 1)  # every request fits the pool alone
    engine = make_engine(tiny_gemma3, max_num_seqs, budget, blocks, block_size, prefix_caching=caching)
    done = drive(engine, workload, [rng.randint(0, 20) for _ in workload])
    for i, (prompt, n) in enumerate(workload):
        assert done[i] == gemma_alone(prompt, n), f"request {i} differs in the mix"
    assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks


def test_a_query_reads_its_whole_context_in_full_layers_and_its_window_in_sliding_ones():
    groups = [KVCacheGroup((0, 2), None), KVCacheGroup((1, 3), 4)]
    spec = KVCacheSpec(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16, groups=groups)
    assert spec.bytes_per_token == 4 * 2 * 8 * 2 and spec.bytes_per_slot == 2 * 2 * 8 * 2
    assert spec.bytes_per_block == 4 * spec.bytes_per_slot
    assert spec.bytes_read(3) == 2 * 3 * spec.bytes_per_slot  # inside the window: every layer reads all 3
    assert spec.bytes_read(10) == (10 + 4) * spec.bytes_per_slot
    one_group = KVCacheSpec(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.bfloat16)
    assert one_group.bytes_read(10) == 10 * one_group.bytes_per_token
