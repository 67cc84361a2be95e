"""`zoo tokenize` as a specification (issue 14, item 3): manifests and tar shards of real media files become
code shards (codes, raw text, no pixels), an index the streaming core reads and a failure manifest naming
every bad input; a rerun skips what is done; a run killed by SIGKILL and rerun ends with exactly the shards
of a run never interrupted.

Tiny untrained tokenizers saved as real config + safetensors files (tests/code_shard_helpers.py).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from code_shard_helpers import Corpus, TokenizerFiles, unified_model, write_corpus, write_tokenizers

from zoo.cli import main
from zoo.datamodules.code_records import CodeRecord
from zoo.datamodules.code_shards import model_fingerprints
from zoo.datamodules.shards import TarSamples, read_index
from zoo.fingerprint import tokenizer_hash
from zoo.hub import save_pretrained
from zoo.pretokenize import FrozenTokenizers
from zoo.tokenizers.audio import AudioCodec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFiles:
    return write_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def tokenize(inputs: list, out: Path, files: TokenizerFiles, *extra: str) -> None:
    main(["tokenize", *map(str, inputs), "--out", str(out), *files.args(), "--quiet", *extra])


def records(out: Path) -> list[CodeRecord]:
    """Every record of the shards the index lists, in index order."""
    found = []
    for shard in read_index(out / "index.json"):
        found += [CodeRecord.from_sample(s) for s in TarSamples().read(shard.url, 0)]
        assert TarSamples().count(shard.url) == shard.samples
    return found


def failures(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("codes-*.tar"))}


def test_a_manifest_becomes_code_shards_an_index_and_a_failure_manifest(files, corpus, tmp_path):
    out = tmp_path / "codes"
    tokenize([corpus.manifest], out, files, "--lines_per_shard", "4", "--num_workers", "0")
    found = records(out)
    assert len(found) == corpus.manifest_good
    assert {r.kind for r in found} == {"image", "video", "audio"}
    assert sorted(shard_bytes(out)) == [f"codes-0000{i}.tar" for i in range(3)]  # 10 lines, 4 a shard
    visual, audio = files.frozen().visual, files.frozen().audio
    for record in found:
        assert record.codes.dtype == np.uint16
        assert record.text.strip() and record.key.startswith("line ")
        assert record.source == str(corpus.manifest)
        if record.kind == "audio":
            assert record.tokenizer_hash == tokenizer_hash(audio)
            assert record.codes.shape[1] == audio.num_levels
        else:
            assert record.tokenizer_hash == tokenizer_hash(visual)
            assert record.scales == visual.scales
            assert record.frames == (2 if record.kind == "video" else 1)  # 3 frames at stride 2; images: 1
    with tarfile.open(out / "codes-00000.tar") as tar:  # codes, text and metadata only: never pixels
        assert {Path(name).suffix for name in tar.getnames()} == {".npy", ".txt", ".json"}
    reasons = failures(out)
    assert len(reasons) == len(corpus.manifest_bad)
    for expected, failure in zip(corpus.manifest_bad, reasons, strict=True):
        assert expected in failure["reason"] and failure["input"] == str(corpus.manifest)
        assert failure["key"].startswith("line ") and failure["shard"].startswith("codes-")
    run = json.loads((out / "tokenize.json").read_text())
    assert run["tokenizers"]["visual_tokenizer"]["hash"] == tokenizer_hash(visual)
    assert run["decode"]["image_size"] == 32 and run["decode"]["video_frames"] == 3


def test_tar_shards_become_one_code_shard_each_the_same_with_or_without_workers(files, corpus, tmp_path):
    tokenize(corpus.shards, tmp_path / "w0", files, "--num_workers", "0", "--batch_size", "2")
    tokenize(corpus.shards, tmp_path / "w2", files, "--num_workers", "2", "--batch_size", "3")
    assert shard_bytes(tmp_path / "w0") == shard_bytes(tmp_path / "w2")
    assert len(shard_bytes(tmp_path / "w0")) == len(corpus.shards)
    found = records(tmp_path / "w2")
    assert len(found) == corpus.shard_good
    assert {r.key for r in found} == {"p0", "p1", "p3", "q0", "q2"}
    assert next(r for r in found if r.key == "p1").text == "speech"  # the caption of a json member
    assert [f["key"] for f in failures(tmp_path / "w2")] == list(corpus.shard_bad)


def test_a_second_run_skips_the_finished_shards(files, corpus, tmp_path, capsys):
    out = tmp_path / "codes"
    tokenize([corpus.manifest], out, files, "--lines_per_shard", "4", "--num_workers", "0")
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("codes-*.tar")}
    index = (out / "index.json").read_text()
    capsys.readouterr()
    tokenize([corpus.manifest], out, files, "--lines_per_shard", "4", "--num_workers", "0")
    assert "0 shards written, 3 already done" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("codes-*.tar")} == before
    assert (out / "index.json").read_text() == index
    assert len(failures(out)) == len(corpus.manifest_bad)  # the failures of skipped shards stay listed


def test_a_folder_of_other_tokenizers_or_reordered_inputs_is_refused(files, corpus, tmp_path):
    out = tmp_path / "codes"
    tokenize(corpus.shards, out, files, "--num_workers", "0")
    other = write_tokenizers(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="holds code shards of another tokenization"):
        tokenize(corpus.shards, out, other, "--num_workers", "0")
    with pytest.raises(ValueError, match="the inputs changed"):
        tokenize(corpus.shards[::-1], out, files, "--num_workers", "0")


def test_an_unreadable_tar_is_listed_not_written_and_the_run_exits_non_zero(files, corpus, tmp_path):
    cut = tmp_path / "cut.tar"
    data = corpus.shards[0].read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # a shard cut in the middle of a member
    out = tmp_path / "codes"
    with pytest.raises(SystemExit, match="1 inputs could not be read"):
        tokenize([cut, corpus.shards[1]], out, files, "--num_workers", "0")
    assert sorted(p.name for p in out.glob("codes-*.tar")) == ["codes-00001.tar"]
    assert [s.url for s in read_index(out / "index.json")] == [str(out / "codes-00001.tar")]
    unreadable = [f for f in failures(out) if f["shard"] is None]
    assert len(unreadable) == 1 and unreadable[0]["input"] == str(cut)
    assert not list(out.glob("*.tmp"))


def test_a_model_folder_gives_its_own_tokenizers(files, corpus, tmp_path):
    model = unified_model(files)
    folder = save_pretrained(model, tmp_path / "exported")
    out = tmp_path / "codes"
    main(["tokenize", str(corpus.shards[1]), "--out", str(out), "--model", str(folder), "--quiet"])
    hashes = model_fingerprints(model)
    assert {r.tokenizer_hash for r in records(out)} == {hashes["visual_tokenizer"], hashes["audio_codec"]}
    visual, audio = files.load()
    assert hashes == {"visual_tokenizer": tokenizer_hash(visual), "audio_codec": tokenizer_hash(audio)}


def test_the_fingerprint_follows_the_weights_not_the_file_they_came_from(files):
    visual, audio = files.load()
    again = files.load()[0]
    assert tokenizer_hash(visual) == tokenizer_hash(again)
    visual.eval().encode(torch.rand(2, 3, 32, 32) * 2 - 1)  # encoding in eval mode changes nothing
    assert tokenizer_hash(visual) == tokenizer_hash(again)
    with torch.no_grad():
        again.quantizer.codebook.embed[0, 0, 0] += 1e-3
    assert tokenizer_hash(visual) != tokenizer_hash(again)


def test_a_codec_whose_kmeans_codebooks_were_never_initialised_is_refused():
    with pytest.raises(ValueError, match="never initialised"):
        FrozenTokenizers(None, AudioCodec(channels=4, max_channels=16, latent_dim=16))


HANG_AT = 3  # samples: units of 2 lines, so unit 0 is committed and unit 1 half read when the run hangs

CHILD = """
import sys, time
from pathlib import Path
from code_shard_helpers import TokenizerFiles
from zoo.pretokenize.command import load_tokenizers, media_spec, parser
from zoo.pretokenize.run import tokenize_corpus

args = parser().parse_args(sys.argv[1:])
def hang(samples):
    if samples >= {hang_at}:
        Path(args.out, "hung").write_text(str(samples))
        time.sleep(600)
tokenizers = load_tokenizers(args)
tokenize_corpus(args.inputs, args.out, tokenizers, media_spec(args), batch_size=args.batch_size,
                num_workers=0, lines_per_shard=args.lines_per_shard, progress=False, on_batch=hang)
"""


def test_a_run_killed_mid_way_and_rerun_ends_with_the_shards_of_an_uninterrupted_run(files, corpus, tmp_path):
    args = [str(corpus.manifest), *files.args(), "--lines_per_shard", "2", "--batch_size", "1"]
    args += ["--num_workers", "0"]
    killed = tmp_path / "killed"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-c", CHILD.format(hang_at=HANG_AT), *args, "--out", str(killed)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (killed / "hung").exists():
            assert child.poll() is None, child.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the run never reached the sample it hangs at"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert sorted(p.name for p in killed.glob("codes-*.tar")) == ["codes-00000.tar"]  # one shard, mid-run
    assert not (killed / "index.json").exists()
    (killed / "codes-00002.tar.tmp").write_bytes(b"half a shard")  # as a kill during a write would leave
    (killed / "hung").unlink()

    main(["tokenize", *args, "--out", str(killed), "--quiet"])
    reference = tmp_path / "reference"
    main(["tokenize", *args, "--out", str(reference), "--quiet"])
    assert shard_bytes(killed) == shard_bytes(reference)
    assert json.loads((killed / "index.json").read_text()) == json.loads(
        (reference / "index.json").read_text()
    )
    assert failures(killed) == failures(reference)
    keys = [r.key for r in records(killed)]
    assert len(keys) == len(set(keys)) == corpus.manifest_good
    assert not list(killed.glob("*.tmp"))


def test_the_npy_member_loads_without_pickle(files, corpus, tmp_path):
    out = tmp_path / "codes"
    tokenize(corpus.shards[1:], out, files, "--num_workers", "0")
    sample = next(TarSamples().read(str(out / "codes-00000.tar"), 0))
    codes = np.load(io.BytesIO(sample["npy"]), allow_pickle=False)
    assert codes.dtype == np.uint16
