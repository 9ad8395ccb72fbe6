"""Hugging Face hub ids as model arguments: `org/name` and `org/name:QUANT`, resolved to files
in huggingface_hub's own cache through its own API (revisions, HF_TOKEN or `hf auth login`,
HF_HOME / HF_HUB_CACHE or --download-dir, HF_HUB_OFFLINE, its progress bars and file locks).

Decisions:
- A model argument that exists on disk is a path, always (as vLLM). One that does not is a hub
  id when it has the shape `org/name[:tag]` (one slash, the hub's name characters, not ending
  in .gguf); anything else is a missing path ("no such file or folder").
- One resolution per argument, pinned to one commit: the revision (default main) is resolved
  by HfApi.resolve_revision (the hub online; the cache's refs/ offline), the commit's file list
  is read from the cache's tree listing, else the hub, else (hub unreachable) the snapshot
  folder as it is on disk; the files are picked from it and fetched by snapshot_download.
- An HF repo (config.json and *.safetensors at the top level) downloads what serving reads: the
  top-level *.json (config, generation config, tokenizer, safetensors index), *.txt (merges),
  *.jinja (chat template), tokenizer.model and *.tiktoken, and the weights: the shards the
  index names when there is an index (a duplicate consolidated.safetensors is left), else every
  top-level *.safetensors. Never .bin / .pt / .onnx / .gguf duplicates, nor subfolders. It must
  hold a tokenizer (tokenizer.json, tokenizer.model or vocab.json): the front end reads it from
  the snapshot folder.
- A GGUF: `org/name:TAG` picks the .gguf whose path carries TAG as a whole word,
  case-insensitively (llama.cpp's `-hf org/name:TAG`); `org/name` picks Q4_K_M when the repo
  has it (llama.cpp's default), else its only .gguf, else an error listing the choices.
  mmproj-* files (vision projectors) never count. Only that file is downloaded: a GGUF carries
  its tokenizer and chat template (loading/gguf.py converts them), so a GGUF repo without
  tokenizer files is fine. A repo with both safetensors and GGUF files serves the safetensors
  unless a tag is given.
- Split GGUFs (-00001-of-0000N): not supported (gguf.py converts one file); an error names the
  parts and says how to merge them.
- Every failure is a HubError whose message names the repo, the revision and, where one is
  missing, the file: offline or unreachable with the file not in the cache, an unknown repo, a
  gated or private one (401/403: set HF_TOKEN), an unknown revision.
- Served name: the argument as given (vLLM's default). A path inside a hub snapshot is named by
  its repo id (hub_model_name), so a pinned config still reports the id.
- Resolve once: pin_hub_model rewrites an EngineConfig's model to the local path before any
  process starts (the CLI, then EngineCore for direct use; a local path passes through), so
  the core, its TP ranks and the front end's tokenizer read the same snapshot and no worker
  downloads. Cores that each resolve (data-parallel AsyncLLM built in code) share the cache
  safely under huggingface_hub's file locks.
- The router (tokenizer_folder) fetches an HF repo's tokenizer and config files only; an
  instance's snapshot path that does not exist on the router's host is fetched as that repo
  and commit. A GGUF repo's tokenizer is inside its weights: refused there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loomserve.config import EngineConfig

DEFAULT_GGUF_TAG = "Q4_K_M"  # llama.cpp's `-hf` default
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_HUB_ID = re.compile(rf"^({_NAME}/{_NAME})(?::([A-Za-z0-9_.-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SNAPSHOT = re.compile(r"(?:^|/)models--(.+?)--([^/]+)/snapshots/([0-9a-f]{40})(?:/|$)")
SERVING_FILES = ("*.json", "*.txt", "*.jinja", "tokenizer.model", "*.tiktoken")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
INDEX = "model.safetensors.index.json"


class HubError(OSError):
    """A hub id that cannot be served; the message says why and what to do."""


def parse_hub_id(arg: str) -> tuple[str, str | None] | None:
    """(repo id, GGUF tag or None) for an argument shaped as a hub id, else None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    m = _HUB_ID.match(arg)
    if m is None or arg.lower().endswith(".gguf"):
        return None
    try:
        validate_repo_id(m.group(1))  # the hub's own rules: no "--" or "..", length, ends
    except HFValidationError:
        return None
    return m.group(1), m.group(2)


def hub_model_name(path: str) -> str | None:
    """The repo id of a path inside a hub cache snapshot (a folder or a file in it), else None."""
    snap = _snapshot_of(path)
    return snap[0] if snap else None


def _snapshot_of(path: str) -> tuple[str, str] | None:
    """(repo id, commit) of a path inside a hub cache snapshot."""
    m = _SNAPSHOT.search(os.path.abspath(path).replace(os.sep, "/"))
    return (f"{m.group(1)}/{m.group(2)}", m.group(3)) if m else None


def pin_hub_model(config: EngineConfig) -> EngineConfig:
    """The config with a hub id replaced by its local snapshot path (downloading what is
    missing) and the id as its served name; unchanged for the default model or a local path.
    FileNotFoundError for a missing local path; HubError for a hub id that cannot be served."""
    mc = config.model
    if mc.model is None or os.path.exists(os.path.expanduser(mc.model)):
        return config
    if parse_hub_id(mc.model) is None:
        raise FileNotFoundError(missing_path_message(mc.model))
    local = resolve_hub_model(mc.model, mc.revision, mc.download_dir)
    model = dataclasses.replace(mc, model=local, served_model_name=mc.served_model_name or mc.model)
    return dataclasses.replace(config, model=model)


def missing_path_message(arg: str) -> str:
    return (f"model {arg!r}: no such file or folder (a hub model is named org/name, "
            "or org/name:QUANT for a GGUF)")


def tokenizer_folder(arg: str) -> str:
    """A folder holding `arg`'s tokenizer and chat template (the router's): a local path as it
    is; a hub id's snapshot with its tokenizer and config files only, no weights; a snapshot
    path from another host (an instance's /info) as that repo and commit, in this host's cache."""
    if os.path.exists(os.path.expanduser(arg)):
        return os.path.expanduser(arg)
    snap = _snapshot_of(arg)
    if snap is not None:
        return resolve_hub_model(snap[0], revision=snap[1], weights=False)
    return resolve_hub_model(arg, weights=False)


def resolve_hub_model(arg: str, revision: str | None = None,
                      download_dir: str | None = None, weights: bool = True) -> str:
    """The local path serving `arg` (a hub id) needs: the snapshot folder of an HF repo, or the
    .gguf file in it; what is not cached yet is downloaded (with progress bars). Without
    weights: an HF repo's folder with its config and tokenizer files only."""
    from huggingface_hub import HfApi, is_offline_mode

    parsed = parse_hub_id(arg)
    if parsed is None:
        raise FileNotFoundError(missing_path_message(arg))
    repo_id, tag = parsed
    where = _Where(repo_id, revision or "main", download_dir)
    with _hub_errors(where):
        rev = HfApi().resolve_revision(repo_id, revision=revision, cache_dir=download_dir,
                                       local_files_only=is_offline_mode())
        where.commit = rev.resolved
        files = _repo_files(where)
        gguf = _pick_gguf(where, files, tag)
        if gguf is not None and not weights:
            raise HubError(f"{where.label()}: a GGUF's tokenizer is inside its weights; name "
                           "the HF repo of the same model, or a local folder")
        if gguf is not None:
            return os.path.join(_fetch(where, rev, [gguf]), gguf)
        return _fetch_hf_repo(where, rev, files, weights)


@dataclasses.dataclass
class _Where:
    """Which repo, revision and commit a resolution is about: what every error names."""

    repo_id: str
    revision: str
    download_dir: str | None
    commit: str | None = None
    from_disk: bool = False  # the file list is the snapshot folder's (hub unreachable)

    @property
    def cache(self) -> str:
        from huggingface_hub import constants
        return self.download_dir or constants.HF_HUB_CACHE

    @property
    def snapshot(self) -> str:
        from huggingface_hub.file_download import repo_folder_name
        folder = repo_folder_name(repo_id=self.repo_id, repo_type="model")
        return os.path.join(os.path.expanduser(self.cache), folder, "snapshots", self.commit or "")

    def label(self) -> str:
        at = f", commit {self.commit[:12]}" if self.commit and self.commit != self.revision else ""
        return f"{self.repo_id} (revision {self.revision}{at})"

    def not_cached(self, missing: list[str]) -> HubError:
        from huggingface_hub import is_offline_mode
        why = ("HF_HUB_OFFLINE=1 is set" if is_offline_mode()
               else "the hub could not be reached")
        rev = "" if self.revision == "main" else f" --revision {self.revision}"
        return HubError(f"{self.label()}: {', '.join(missing)} missing from the hub cache "
                        f"({self.cache}), and {why}: download it once online (e.g. "
                        f"`hf download {self.repo_id}{rev}`), or point HF_HUB_CACHE / "
                        "--download-dir at a cache that has it")

    def absent(self, what: str, reason: str) -> HubError:
        """`what` is not there: missing from the cache when the listing came from it (offline),
        else missing from the repo (`reason`)."""
        return self.not_cached([what]) if self.from_disk else HubError(f"{self.label()}: {reason}")


@contextlib.contextmanager
def _hub_errors(w: _Where):
    """huggingface_hub's exceptions -> HubError naming the repo, the revision, what to do."""
    from huggingface_hub import errors as e

    try:
        yield
    except HubError:
        raise
    except e.GatedRepoError as exc:
        raise HubError(f"{w.repo_id} is a gated repo: accept its terms on "
                       f"https://huggingface.co/{w.repo_id}, then set HF_TOKEN (or run "
                       "`hf auth login`)") from exc
    except e.RepositoryNotFoundError as exc:
        raise HubError(f"model {w.repo_id!r} is not a local path, and the Hugging Face hub has "
                       "no model repo of that name (a private one needs HF_TOKEN)") from exc
    except e.RevisionNotFoundError as exc:
        raise HubError(f"{w.repo_id} has no revision {w.revision!r} on the hub") from exc
    except e.RevisionResolutionError as exc:
        raise w.not_cached([f"revision {w.revision!r}"]) from exc
    except e.LocalEntryNotFoundError as exc:  # snapshot_download found no snapshot offline
        raise w.not_cached(["the snapshot"]) from exc
    except e.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubError(f"{w.label()}: the hub refused access ({status}): set HF_TOKEN to "
                           "a token that may read it (or run `hf auth login`)") from exc
        raise HubError(f"{w.label()}: the hub answered {status}: {exc}") from exc


def _repo_files(where: _Where) -> list[str]:
    """The commit's files: the cached tree listing, else the hub's, else (the hub unreachable)
    the snapshot folder's files as they are on disk."""
    from huggingface_hub import HfApi, get_cached_repo_tree, is_offline_mode
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, HfHubHTTPError

    try:
        tree = get_cached_repo_tree(where.repo_id, revision=where.commit,
                                    cache_dir=where.download_dir)
        return sorted(f.path for f in tree)
    except CachedRepoTreeNotFoundError:
        pass
    if not is_offline_mode():
        try:
            return sorted(HfApi().list_repo_files(where.repo_id, revision=where.commit))
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code < 500:
                raise
        except Exception:  # noqa: BLE001 - unreachable: what the cache holds, as hf does
            pass
    where.from_disk = True
    return _files_on_disk(where)


def _files_on_disk(where: _Where) -> list[str]:
    root = where.snapshot
    if not os.path.isdir(root):
        raise where.not_cached(["the snapshot"])
    out = []
    for folder, _, names in os.walk(root, followlinks=True):
        for n in names:
            path = os.path.join(folder, n)
            if os.path.isfile(path):  # a dangling link is a file not downloaded
                out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(out)


def _fetch(where: _Where, rev, names: list[str]) -> str:
    """snapshot_download of exactly `names` at the pinned commit; the snapshot folder. A name
    still missing (offline, no tree listing to tell hf) is named in the error."""
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(where.repo_id, revision=rev, cache_dir=where.download_dir,
                                   allow_patterns=[_literal(n) for n in names],
                                   local_files_only=is_offline_mode())
    except LocalEntryNotFoundError:  # offline: a snapshot missing files, or none at all
        folder = where.snapshot
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise where.not_cached(missing)
    return folder


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly `name`."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _fetch_hf_repo(where: _Where, rev, files: list[str], weights: bool = True) -> str:
    top = [f for f in files if "/" not in f]
    if "config.json" not in top:
        raise where.absent("config.json", "holds neither config.json nor a .gguf file: not a "
                           "model loomserve can serve")
    shards = [f for f in top if f.endswith(".safetensors")]
    if weights and not shards and INDEX not in top:
        others = [f for f in top if f.endswith((".bin", ".pt", ".pth"))]
        raise where.absent("model.safetensors", "no model.safetensors in the repo" + (
            f" (it has {', '.join(others[:3])}: loomserve reads safetensors only)"
            if others else ""))
    if not any(f in top for f in TOKENIZER_FILES):
        raise where.absent("tokenizer.json", f"no tokenizer ({' or '.join(TOKENIZER_FILES)}) "
                           "in the repo")
    meta = [f for f in top if any(fnmatch.fnmatch(f, p) for p in SERVING_FILES)
            and not f.endswith((".bin.index.json", ".pt.index.json"))]
    folder = _fetch(where, rev, ["config.json"] + [f for f in meta if f != "config.json"])
    if not weights:
        return folder
    if INDEX in top:
        with open(os.path.join(folder, INDEX)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    _fetch(where, rev, shards)
    return folder


def _pick_gguf(where: _Where, files: list[str], tag: str | None) -> str | None:
    """The .gguf to serve, or None for an HF repo (module docstring)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")
             and not os.path.basename(f).lower().startswith("mmproj")]
    # a config.json beside GGUFs alone is not an HF checkpoint; offline, what the disk lacks
    # may be in the repo still: config.json is enough then
    hf = "config.json" in files and (where.from_disk or any(
        f.endswith(".safetensors") or f == INDEX for f in files if "/" not in f))
    if tag is None and (hf or not ggufs):
        return None
    if tag is not None and not ggufs:
        raise where.absent(f"a .gguf file carrying {tag!r}", f"no .gguf file, so the tag :{tag} "
                           "picks nothing (drop it to serve the repo's safetensors)")
    groups = _split_groups([f for f in ggufs if _carries(f, tag)] if tag else ggufs)
    if tag is None and len(groups) > 1:
        tagged = _split_groups([f for f in ggufs if _carries(f, DEFAULT_GGUF_TAG)])
        groups = tagged if len(tagged) == 1 else groups
    if not groups and where.from_disk:
        raise where.not_cached([f"a .gguf file carrying {tag!r}"])
    if len(groups) != 1:
        what = (f"{len(groups)} .gguf files match" if groups
                else f"no .gguf file carries the tag {tag!r}")
        choices = ", ".join(sorted(groups or _split_groups(ggufs)))
        raise HubError(f"{where.label()}: {what}; pick one as {where.repo_id}:TAG "
                       f"(its quant, e.g. Q4_K_M) among: {choices}")
    (name, parts), = groups.items()
    if len(parts) > 1 or _SPLIT.search(parts[0]):
        raise HubError(f"{where.label()}: {name} is a split GGUF ({', '.join(parts)}); loomserve "
                       "reads one file: merge them with `llama-gguf-split --merge`, or pick a "
                       "smaller quant")
    return parts[0]


def _carries(path: str, tag: str) -> bool:
    """The tag as a whole word of the path, case-insensitively: Q4_K matches x-Q4_K.gguf,
    not x-Q4_K_M.gguf."""
    return re.search(rf"(?<![a-z0-9]){re.escape(tag.lower())}(?![a-z0-9_])",
                     path.lower()) is not None


def _split_groups(files: list[str]) -> dict[str, list[str]]:
    """Files by the model they hold: the parts of a split GGUF under one name."""
    groups: dict[str, list[str]] = {}
    for f in sorted(files):
        groups.setdefault(_SPLIT.sub(".gguf", f), []).append(f)
    return groups
