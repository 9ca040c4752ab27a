"""The model zoo: one transformers config per architecture and size, built with seeded random weights.

``tiny`` configs keep the test suite fast; ``small`` ones (``llama-small`` is the benchmark
default: ~57M parameters, hidden 512, 8 layers, 8 query / 2 KV heads, vocab 32000) are for CPU
benchmarks; ``llama-1b`` (~1.1B parameters, hidden 2048, 16 layers, 32 query / 8 KV heads, MLP
8192, vocab 32000) is sized for a GPU, built in its dtype straight on the device. Weights are never downloaded. Each vocabulary size has a byte-level BPE tokenizer with a
chat template (``load_tokenizer``; built by ``scripts/build_tokenizers.py``). Configs and tokenizers
live in the repository's ``models/``; a wheel ships them inside the package (``flexpage/configs``,
``flexpage/tokenizers``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

_PACKAGED = Path(__file__).parent  # an installed wheel: flexpage/configs, flexpage/tokenizers
_DATA = _PACKAGED if (_PACKAGED / "configs").is_dir() else Path(__file__).resolve().parents[1] / "models"
CONFIG_DIR, TOKENIZER_DIR = _DATA / "configs", _DATA / "tokenizers"
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
DEFAULT_MODEL = "llama-small"


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name: str, **overrides) -> PretrainedConfig:
    """The config named ``<architecture>-<size>`` (e.g. ``llama-tiny``), with ``overrides`` applied."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available())}")
    data = json.loads(path.read_text()) | overrides
    return AutoConfig.for_model(data.pop("model_type"), **data)


def build(
    name: str = DEFAULT_MODEL,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    **overrides,
) -> PreTrainedModel:
    """A causal LM from config ``name`` with seeded random weights, in eval mode, its weights
    created on ``device`` (a GPU-sized model never passes through host memory).

    ``attn_implementation`` defaults to sdpa where the architecture supports it, else eager; a
    model with attention-logit softcapping always defaults to eager, since SDPA would silently drop
    the softcap (transformers before 5.18 chose SDPA for Gemma 2).
    """
    config = load_config(name, **overrides)
    if attn_implementation is None and getattr(config, "attn_logit_softcapping", None):
        attn_implementation = "eager"
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def load(name_or_dir: str = DEFAULT_MODEL, **kwargs) -> PreTrainedModel:
    """A zoo model by name (``build``), or a model saved with ``save_pretrained`` in a local
    directory (``from_pretrained``; never downloads), in eval mode."""
    if Path(name_or_dir).is_dir():
        kwargs.pop("seed", None)
        return AutoModelForCausalLM.from_pretrained(name_or_dir, local_files_only=True, **kwargs).eval()
    return build(name_or_dir, **kwargs)


def load_tokenizer(name_or_dir: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of a zoo model (by its vocabulary size) or of a local model directory."""
    if Path(name_or_dir).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name_or_dir, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"{name_or_dir} has no tokenizer files (save one with tokenizer.save_pretrained)") from error
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR / f"vocab-{load_config(name_or_dir).vocab_size}")


def model_choice(value: str) -> str:
    """argparse type for ``--model``: a zoo name or a local model directory."""
    if value in available() or Path(value).is_dir():
        return value
    raise ValueError(f"{value!r} is neither a zoo model ({', '.join(available())}) nor a local directory")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' ``--model``; resolve it with ``chosen_model`` (``--quick`` picks llama-tiny)."""
    parser.add_argument("--model", type=model_choice,
                        help=f"a zoo model ({', '.join(available())}) or a local save_pretrained directory "
                             f"(default: {DEFAULT_MODEL}, llama-tiny with --quick)")


def chosen_model(args: argparse.Namespace) -> str:
    """``--model``, else the default for the mode (``llama-tiny`` with ``--quick``)."""
    return args.model or ("llama-tiny" if getattr(args, "quick", False) else DEFAULT_MODEL)
