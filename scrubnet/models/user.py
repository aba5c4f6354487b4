"""The user's own model, from the command line: a factory (or a HuggingFace directory) and a weights file.

**HuggingFace directory.** ``hf:DIR`` loads ``AutoModelForSequenceClassification.from_pretrained(DIR,
local_files_only=True)`` (``AutoModelForCausalLM`` when its config's ``architectures`` name a causal LM:
``…ForCausalLM`` or ``…LMHeadModel``) (``config.json`` and the weights in DIR; nothing is downloaded; ``--model-option``
values are passed to ``from_pretrained``). Its forward takes the token ids positionally and the further
inputs (``attention_mask``, ``token_type_ids`` …) as keyword arguments, as the ``.npz``'s ``train_<name>``
arrays give them; its ``ModelOutput``'s ``.logits`` are read. The weights file may be DIR's own
``model.safetensors``, or scrubbed weights scrubnet wrote for it.

**Factory.** ``FILE.py:NAME`` (a Python file) or ``MODULE:NAME`` (an importable module, e.g. ``mypkg.nets:make``)
names a callable that builds the *untrained* architecture: ``NAME(**options)`` must return an ``nn.Module``
whose ``state_dict`` keys and shapes are those of the weights file. ``options`` are the JSON values of the
CLI's repeatable ``--model-option KEY=VALUE`` (none: the factory is called without arguments). Loading a
factory **executes the user's code** (the file or module is imported), exactly as ``python FILE.py`` would:
name only files you trust. The file's folder is on ``sys.path`` while it is imported, so it may import its
neighbours.

**Weights.** A ``.safetensors`` file, or anything else as a ``torch.save`` state_dict read with
``torch.load(weights_only=True)`` (tensors and plain containers only: nothing is unpickled that could run
code). A dict holding the state_dict under ``state_dict``, ``model_state_dict`` or ``model`` (common training
checkpoints) is unwrapped. Before loading, names and shapes are compared with the model's own state_dict and
the first few mismatches named; non-finite tensors are refused.
"""
from __future__ import annotations

import hashlib
import json
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

#: the ``arch`` scrubnet records in the sidecar of weights it wrote for a user's model (rebuilt from the
#: factory named there, not from the zoo)
USER_ARCH = "user-factory"

#: keys under which training checkpoints commonly nest the state_dict
NESTED_STATE_KEYS = ("state_dict", "model_state_dict", "model")


class UserModelError(ValueError):
    """A factory or weights file that cannot give the model asked for (message names the cause)."""


def _few(names: list[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def split_factory_spec(spec: str) -> tuple[str, str]:
    """(source, callable name) of ``FILE.py:NAME`` or ``MODULE:NAME``; ``UserModelError`` if malformed."""
    if ":" not in spec:
        raise UserModelError(f"--model {spec!r}: expected FILE.py:FACTORY or MODULE:FACTORY (a callable that "
                             "returns the untrained nn.Module)")
    source, name = spec.rsplit(":", 1)
    if not source or not name.isidentifier():
        raise UserModelError(f"--model {spec!r}: expected FILE.py:FACTORY or MODULE:FACTORY, with FACTORY a "
                             "Python name")
    return source, name


#: the prefix of a HuggingFace model directory in ``--model``
HF_PREFIX = "hf:"


def check_hf_directory(directory: str | Path) -> Path:
    """``directory`` as a path, checked to be a HuggingFace model directory that can be loaded here: it exists,
    holds a ``config.json``, and ``transformers`` is installed; ``UserModelError`` naming the cause otherwise
    (checked before any other input, so a bad ``hf:DIR`` is never reported as a missing weights file)."""
    path = Path(directory)
    if not path.is_dir():
        raise UserModelError(f"--model hf:{directory}: no such directory")
    if not (path / "config.json").is_file():
        raise UserModelError(f"--model hf:{directory}: not a HuggingFace model directory (no config.json)")
    try:
        import transformers  # noqa: F401 - only whether it is installed
    except ImportError as e:
        raise UserModelError(f"--model hf:{directory} needs the transformers package (pip install "
                             f"'scrubnet[hf]'): {e}") from None
    return path


def load_hf_model(directory: str | Path, options: dict[str, Any] | None = None) -> nn.Module:
    """``AutoModelForSequenceClassification`` (or, for a causal LM's config, ``AutoModelForCausalLM``)
    ``.from_pretrained(directory, local_files_only=True, **options)``,
    in eval mode; ``UserModelError`` naming the cause (no transformers, no such directory, a bad config)."""
    path = check_hf_directory(directory)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    try:
        # a causal language model (its config names a ...ForCausalLM / ...LMHeadModel architecture) keeps its LM head
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
        causal = any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)
        auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
        model = auto.from_pretrained(str(path), local_files_only=True, **(options or {}))
    except Exception as e:  # noqa: BLE001 - transformers raises many types on a bad directory
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserModelError(f"--model hf:{directory}: from_pretrained failed: {type(e).__name__}: {first}") from None
    return model.eval()


def factory_source_sha256(spec: str) -> str | None:
    """sha256 of the factory's Python file (None for a module spec; for ``hf:DIR`` that of DIR's config.json):
    recorded in what scrubnet writes."""
    if spec.startswith(HF_PREFIX):
        cfg = Path(spec[len(HF_PREFIX):]) / "config.json"
        return hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None
    source, _ = split_factory_spec(spec)
    path = Path(source)
    if source.endswith(".py") and path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return None


def _import_file(path: Path):
    name = "scrubnet_user_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserModelError(f"--model: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and typing resolve the module by name while it executes
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything; report it in one line
        sys.modules.pop(name, None)
        raise UserModelError(f"--model: importing {path} failed: {type(e).__name__}: {e}") from None
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return module


def load_factory(spec: str):
    """The callable named by ``spec`` (module docstring). Imports (executes) the user's file or module."""
    source, name = split_factory_spec(spec)
    if source.endswith(".py") or "/" in source or "\\" in source:
        path = Path(source)
        if not path.is_file():
            raise UserModelError(f"--model: model file not found: {path}")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as e:
            raise UserModelError(f"--model: cannot import module {source!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the user's module raised while importing
            raise UserModelError(f"--model: importing module {source!r} failed: {type(e).__name__}: {e}") from None
    factory = getattr(module, name, None)
    if factory is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserModelError(f"--model: {source} has no {name!r}" + (f" (callables defined there: {_few(found, 5)})"
                                                                      if found else ""))
    if not callable(factory):
        raise UserModelError(f"--model: {source}:{name} is a {type(factory).__name__}, not a callable")
    return factory


def build_user_model(spec: str, options: dict[str, Any] | None = None) -> nn.Module:
    """``factory(**options)`` of :func:`load_factory` (``hf:DIR``: :func:`load_hf_model`), checked to be an
    ``nn.Module``; in eval mode."""
    if spec.startswith(HF_PREFIX):
        return load_hf_model(spec[len(HF_PREFIX):], options)
    factory = load_factory(spec)
    try:
        model = factory(**(options or {}))
    except TypeError as e:
        raise UserModelError(f"--model {spec}: calling the factory with options {options or {}} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        raise UserModelError(f"--model {spec}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise UserModelError(f"--model {spec}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a weights file (module docstring): safetensors, or a torch.save state_dict read with
    ``weights_only=True``; nested state_dicts unwrapped; every value checked to be a tensor."""
    path = Path(path)
    if not path.is_file():
        raise UserModelError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        try:
            state = load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types on a bad header
            raise UserModelError(f"{path} is not a readable safetensors file: {e}") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError …: not a state_dict
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserModelError(f"{path} is not a torch.save state_dict readable with weights_only=True "
                                 f"(tensors and plain containers only): {first}") from None
    if isinstance(state, dict):
        for key in NESTED_STATE_KEYS:
            if isinstance(state.get(key), dict) and all(isinstance(v, Tensor) for v in state[key].values()):
                state = state[key]
                break
    if not isinstance(state, dict) or not state:
        raise UserModelError(f"{path} holds a {type(state).__name__}, not a state_dict (a dict of tensors)")
    bad = [str(k) for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
    if bad:
        raise UserModelError(f"{path}: entries that are not named tensors: {_few(bad)}")
    return state


def load_user_weights(model: nn.Module, state: dict[str, Tensor], source: str) -> nn.Module:
    """Load ``state`` into ``model`` after checking names, shapes and finiteness against the model's own
    state_dict; ``source`` names the weights in the messages. Returns the model in eval mode."""
    expected = model.state_dict()
    state = dict(state)
    # tied weights (a causal LM's lm_head is its input embedding): save_pretrained stores the tensor once; an
    # entry sharing its storage with another the file holds is filled from that one
    by_ptr = {}
    for k, v in expected.items():
        by_ptr.setdefault((v.data_ptr(), tuple(v.shape)), []).append(k)
    for names in by_ptr.values():
        present = [k for k in names if k in state]
        for k in names:
            if k not in state and present and len(names) > 1:
                state[k] = state[present[0]]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing {_few(missing)}"] if missing else []) + ([f"unexpected {_few(unexpected)}"]
                                                                     if unexpected else [])
        raise UserModelError(f"{source} does not match the model built by the factory: {'; '.join(parts)}")
    shapes = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if shapes:
        k = shapes[0]
        raise UserModelError(f"{source}: tensor {k} has shape {tuple(state[k].shape)}, the model needs "
                             f"{tuple(expected[k].shape)}" + (f" (and {len(shapes) - 1} more)" if len(shapes) > 1
                                                                else ""))
    nonfinite = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        raise UserModelError(f"{source} has non-finite weights (NaN or inf) in {_few(nonfinite)}")
    model.load_state_dict(state)
    return model.eval()
