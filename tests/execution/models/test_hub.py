"""Hub ids as model arguments (loomserve/execution/models/loading/hub.py), offline: a hub cache
laid out on disk as huggingface_hub writes it (models--org--name/{blobs, refs, snapshots, trees},
snapshot files relative symlinks to blobs named by their etag), HF_HUB_OFFLINE=1 and
HF_HUB_CACHE pointing at it. No test reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from loomserve.execution.models.loading.hub import (
    HubError,
    _hub_errors,
    _Where,
    pin_hub_model,
    resolve_hub_model,
    tokenizer_folder,
)
from tests.execution.models.conftest import FIXTURES

gguf = pytest.importorskip("gguf")

TINY = FIXTURES / "tiny-llama"
REPO = "tiny-org/tiny-llama"
GGUF_REPO = "tiny-org/tiny-GGUF"
MAIN = hashlib.sha1(b"main").hexdigest()
V1 = hashlib.sha1(b"v1").hexdigest()
LFS = (".safetensors", ".gguf")


def _etag(data: bytes, lfs: bool) -> str:
    """The blob name huggingface_hub stores a file under: its sha256 for an LFS file, else its
    git blob id."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out(cache: Path, repo_id: str, commit: str, files: dict[str, bytes],
            refs: tuple[str, ...] = ("main",), tree: bool = True,
            skip: tuple[str, ...] = ()) -> Path:
    """One commit of a repo in a hub cache, as huggingface_hub 2.x writes it; the files in
    `skip` are listed in the tree (the repo has them) but not downloaded. The snapshot folder."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    entries = {}
    for name, data in files.items():
        lfs = name.endswith(LFS)
        etag = _etag(data, lfs)
        entries[name] = {"size": len(data), "blob_id": _etag(data, False)}
        if lfs:
            entries[name].update(lfs_sha256=etag, lfs_size=len(data))
        if name in skip:
            continue
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    if tree:
        (storage / "trees").mkdir(exist_ok=True)
        (storage / "trees" / f"{commit}.json").write_text(
            json.dumps({"format_version": 1, "files": entries}))
    return snapshot


# what a real repo also holds and serving must not download
NOT_SERVED = ("pytorch_model.bin", "onnx/model.onnx", "model.gguf", "README.md")


def tiny_files(**extra: bytes) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in TINY.iterdir()}
    files.update({name: b"\0" * 64 for name in NOT_SERVED}, **extra)
    return files


def tiny_gguf(quant: str) -> bytes:
    """A small valid GGUF (gguf-py's writer) whose metadata names its quant."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_string("general.name", f"tiny-{quant}")
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The offline hub cache every test reads (HF_HUB_CACHE, HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hf") / "hub"
    # the repo has more than serving reads; only what it reads was downloaded
    lay_out(cache, REPO, MAIN, tiny_files(), skip=NOT_SERVED)
    # revision v1: another commit with its own config (a longer context)
    config = json.loads((TINY / "config.json").read_text())
    config["max_position_embeddings"] = 128
    lay_out(cache, REPO, V1, tiny_files(**{"config.json": json.dumps(config).encode()}),
            refs=("v1",), skip=NOT_SERVED)
    quants = ["Q4_K_M", "Q4_K_S", "Q8_0"]
    lay_out(cache, GGUF_REPO, MAIN, {
        **{f"tiny-{q}.gguf": tiny_gguf(q) for q in quants},
        "mmproj-tiny-f16.gguf": tiny_gguf("f16"), "README.md": b"# gguf\n",
        "config.json": (TINY / "config.json").read_bytes()})  # some GGUF repos carry one
    lay_out(cache, "tiny-org/one-GGUF", MAIN, {"one-F16.gguf": tiny_gguf("F16"),
                                               "mmproj-one.gguf": tiny_gguf("f16")})
    lay_out(cache, "tiny-org/split-GGUF", MAIN, {
        "big-Q8_0-00001-of-00002.gguf": tiny_gguf("Q8_0"),
        "big-Q8_0-00002-of-00002.gguf": tiny_gguf("Q8_0"), "big-Q4_0.gguf": tiny_gguf("Q4_0")})
    # downloads that never finished: the repo's tree names files the cache lacks
    lay_out(cache, "tiny-org/partial", MAIN, tiny_files(), skip=("model.safetensors",))
    lay_out(cache, "tiny-org/partial-old", MAIN, tiny_files(), skip=("model.safetensors",),
            tree=False)  # a cache written before trees/ existed: the disk is all there is
    lay_out(cache, "tiny-org/partial-GGUF", MAIN, {"p-Q8_0.gguf": tiny_gguf("Q8_0")},
            skip=("p-Q8_0.gguf",))
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(cache))):
            mp.setenv(name, "1" if value is True else value)
            mp.setattr(constants, name, value)  # read once, when huggingface_hub was imported
        yield cache


def snapshot(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit)


def test_hub_id_loads_and_generates_what_transformers_does(hub):
    from transformers import AutoModelForCausalLM

    from loomserve import LLM
    from loomserve.sampling_params import SamplingParams

    llm = LLM(REPO, dtype="float32", device="cpu", kv_cache_memory="2MB")
    ready = llm.core.ready()
    assert ready.model_folder == snapshot(hub, REPO, MAIN)
    # the config every rank and worker process gets: the snapshot, nothing left to resolve
    assert llm.core.config.model.model == snapshot(hub, REPO, MAIN)
    assert ready.model_name == REPO  # served under the id, as vLLM does
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0.0, max_tokens=6))[0]
    ref = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=6,
                            do_sample=False)[0, len(out.prompt_token_ids):].tolist()
    assert out.token_ids == want


def test_a_revision_picks_its_commit(hub):
    from loomserve.execution.models.loading.loader import resolve_config

    assert resolve_hub_model(REPO) == snapshot(hub, REPO, MAIN)
    assert resolve_hub_model(REPO, revision="v1") == snapshot(hub, REPO, V1)
    assert resolve_hub_model(REPO, revision=V1) == snapshot(hub, REPO, V1)
    main_cfg = resolve_config(REPO, str(hub.parent / "conv"))[1]
    v1_cfg = resolve_config(snapshot(hub, REPO, V1), str(hub.parent / "conv"))[1]
    assert (main_cfg.max_position_embeddings, v1_cfg.max_position_embeddings) == (256, 128)
    with pytest.raises(HubError, match=rf"{REPO}.*revision 'v2'.*HF_HUB_OFFLINE"):
        resolve_hub_model(REPO, revision="v2")


def test_pinning_rewrites_the_config_once_for_every_process(hub):
    from loomserve.config import EngineConfig

    config = EngineConfig.from_kwargs(model=REPO, revision="v1")
    pinned = pin_hub_model(config)
    assert pinned.model.model == snapshot(hub, REPO, V1)
    assert pinned.model.served_model_name == REPO
    assert pin_hub_model(pinned) == pinned  # a local path: nothing to resolve again
    named = pin_hub_model(EngineConfig.from_kwargs(model=REPO, served_model_name="m"))
    assert named.model.served_model_name == "m"


@pytest.mark.parametrize("arg, file", [
    (f"{GGUF_REPO}:Q8_0", "tiny-Q8_0.gguf"),
    (f"{GGUF_REPO}:q4_k_s", "tiny-Q4_K_S.gguf"),  # case-insensitive
    (GGUF_REPO, "tiny-Q4_K_M.gguf"),  # llama.cpp's default quant
    ("tiny-org/one-GGUF", "one-F16.gguf"),  # the only model file (mmproj does not count)
    ("tiny-org/split-GGUF:Q4_0", "big-Q4_0.gguf"),
])
def test_a_gguf_tag_picks_its_file(hub, arg, file):
    path = resolve_hub_model(arg)
    assert path == os.path.join(snapshot(hub, arg.split(":")[0], MAIN), file)
    want = file.split("-", 1)[1].removesuffix(".gguf")
    name = gguf.GGUFReader(path).fields["general.name"].contents()
    assert name.lower() == f"tiny-{want}".lower()  # the file's own bytes, not a neighbour's


def test_gguf_choices_that_pick_nothing_name_the_choices(hub):
    with pytest.raises(HubError, match=r"Q5_K_M.*tiny-Q4_K_M\.gguf.*tiny-Q8_0\.gguf"):
        resolve_hub_model(f"{GGUF_REPO}:Q5_K_M")
    with pytest.raises(HubError, match=r"split GGUF.*big-Q8_0-00001-of-00002\.gguf.*merge"):
        resolve_hub_model("tiny-org/split-GGUF:Q8_0")
    with pytest.raises(HubError, match=r"2 \.gguf files.*big-Q4_0\.gguf"):
        resolve_hub_model("tiny-org/split-GGUF")
    with pytest.raises(HubError, match=r"no \.gguf file carries the tag 'Q8_0'.*model\.gguf"):
        resolve_hub_model(f"{REPO}:Q8_0")


@pytest.mark.parametrize("arg, file", [
    ("tiny-org/partial", "model.safetensors"),  # the tree says the repo has it
    ("tiny-org/partial-old", "model.safetensors"),  # no tree: what the snapshot lacks
    ("tiny-org/partial-GGUF:Q8_0", "p-Q8_0.gguf"),
    ("tiny-org/never-downloaded", "revision 'main'"),
])
def test_offline_a_file_not_in_the_cache_is_a_clear_error(hub, arg, file):
    repo = arg.split(":")[0]
    with pytest.raises(HubError) as e:
        resolve_hub_model(arg)
    msg = str(e.value)
    for piece in (repo, "revision main", file, "HF_HUB_OFFLINE=1", str(hub)):
        assert piece in msg, (piece, msg)


def test_a_missing_local_path_is_no_such_file(hub):
    from loomserve.config import EngineConfig
    from loomserve.execution.models.loading.loader import resolve_model

    for arg in ("./nope", "/no/such/dir", "nope", "org/model.gguf", "org/name-"):
        with pytest.raises(FileNotFoundError, match="no such file") as e:
            resolve_model(arg, str(hub.parent / "conv"))
        assert not isinstance(e.value, HubError)
        with pytest.raises(FileNotFoundError, match="no such file"):
            pin_hub_model(EngineConfig.from_kwargs(model=arg))


def test_the_router_fetches_a_hub_tokenizer_without_weights(hub):
    from loomserve.control.router.tokens import PromptKeys

    # tiny-org/partial's weights are not cached: the tokenizer files are all the router needs
    folder = tokenizer_folder("tiny-org/partial")
    assert folder == snapshot(hub, "tiny-org/partial", MAIN)
    keys = PromptKeys.from_folder(folder, 4)
    assert keys.tok.encode("hello world") == PromptKeys.from_folder(str(TINY), 4).tok.encode(
        "hello world")
    # an instance's snapshot path from another host: the same repo and commit, here
    elsewhere = "/srv/other-host/hub/models--tiny-org--tiny-llama/snapshots/" + V1
    assert tokenizer_folder(elsewhere) == snapshot(hub, REPO, V1)
    with pytest.raises(HubError, match="tokenizer is inside its weights"):
        tokenizer_folder(f"{GGUF_REPO}:Q8_0")


def _http_error(kind, status: int):
    import httpx2

    url = f"https://huggingface.co/api/models/{REPO}"
    return kind("hub says no", response=httpx2.Response(status, request=httpx2.Request("GET", url)))


@pytest.mark.parametrize("kind, status, want", [
    ("GatedRepoError", 403, r"gated repo: accept its terms on https://huggingface.co/tiny-org/"
                            r"tiny-llama, then set HF_TOKEN"),
    ("RepositoryNotFoundError", 404, r"'tiny-org/tiny-llama' is not a local path, and the "
                                     r"Hugging Face hub has no model repo"),
    ("RevisionNotFoundError", 404, r"tiny-org/tiny-llama has no revision 'v9'"),
    ("HfHubHTTPError", 401, r"tiny-org/tiny-llama \(revision v9\).*refused access \(401\): set "
                            r"HF_TOKEN"),
])
def test_hub_answers_become_clear_errors(kind, status, want):
    """What huggingface_hub raises when the hub answers (it is not reached in tests)."""
    from huggingface_hub import errors

    with pytest.raises(HubError, match=want):
        with _hub_errors(_Where(REPO, "v9", None)):
            raise _http_error(getattr(errors, kind), status)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_reports_a_hub_id_it_cannot_serve_as_a_startup_error(hub, capsys):
    """Before any process starts: one line on stderr, exit code 1, as an engine that cannot
    start (EngineStartError) is reported."""
    from loomserve.cli import main

    assert main(["serve", "tiny-org/no-such-model"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loomserve: error: tiny-org/no-such-model (revision main): revision "
                          "'main' missing from the hub cache"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["serve", "./nope"]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_serve_a_hub_id_from_the_offline_cache(hub):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", REPO, "--port", str(port),
         "--kv-cache-memory", "4MiB", "--dtype", "float32", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [REPO]
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": REPO, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert snapshot(hub, REPO, MAIN) in out  # the startup line names the snapshot it serves
