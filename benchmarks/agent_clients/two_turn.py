"""The real agent CLIs, two turns each, against the built-in model started as README.md says.

The server command is read from README.md (the `loomserve serve ... --hf-overrides ...` line of
"Pointing an agent client at it"), so this checks the command a user copies. For each client
(Claude Code with its default tools, Codex), in a fresh HOME and folder:
  turn 1  `claude -p PROMPT1`            `codex exec --skip-git-repo-check PROMPT1`
  turn 2  `claude -p --continue PROMPT2`  `codex exec --skip-git-repo-check resume --last PROMPT2`
through the recording proxy (proxy.py). Per turn: exit code, seconds, each request's path and
status, and the server's prefix-cache counters over the turn (`loomserve_prefix_cache_queried_
tokens` / `_hit_tokens` from /metrics): the second turn resends the first turn's context, and
its hit share is what the prefix cache served.

Run (the clients from npm, no global install):
    npm install --prefix /tmp/agent-clients @anthropic-ai/claude-code @openai/codex
    python benchmarks/agent_clients/two_turn.py [--clients claude codex]
Output: benchmarks/results/agent_clients_two_turn.json (client versions, the server command).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common.paths import REPO_ROOT  # noqa: E402
from common.results import write_json  # noqa: E402
from common.servers import ServerProcess, free_port, which_loomserve  # noqa: E402
from proxy import Recorder  # noqa: E402
from try_clients import CLIENTS, QUIET_ENV, run_cli, start_proxy  # noqa: E402

RESULT = "agent_clients_two_turn.json"
PROMPTS = ("say hi", "now say it in French")


def readme_serve_command() -> list[str]:
    """The `loomserve serve` line README.md gives agent clients (the one with --hf-overrides)."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        for line in f:
            if line.startswith("loomserve serve") and "--hf-overrides" in line:
                return shlex.split(line, comments=True)
    raise SystemExit("README.md has no `loomserve serve ... --hf-overrides` line")


def cache_counters(base: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens served) from the prefix cache, cumulative."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("loomserve_prefix_cache_queried_tokens_total",
                          "loomserve_prefix_cache_hit_tokens_total"):
                got[s.name] = s.value
    return (got.get("loomserve_prefix_cache_queried_tokens_total", 0.0),
            got.get("loomserve_prefix_cache_hit_tokens_total", 0.0))


def turn_argv(name: str, argv: list[str], turn: int, prompt: str) -> list[str]:
    """The client's argv for turn 1 (as try_clients builds it) or turn 2 (continuing)."""
    if turn == 1:
        return argv
    if name == "claude":
        return [argv[0], "-p", "--continue", prompt, *argv[3:]]
    return [argv[0], "exec", "--skip-git-repo-check", "resume", "--last", prompt]


def run_turns(name: str, bin_dir: str, proxy_base: str, server: str, model: str,
              recorder: Recorder, log: str, timeout: float) -> dict:
    home = tempfile.mkdtemp(prefix=f"two-turn-{name}-")
    argv, env = CLIENTS[name](bin_dir, proxy_base, model, home, PROMPTS[0])
    env = {**os.environ, **QUIET_ENV, "HOME": home, "PWD": home,
           "XDG_CONFIG_HOME": os.path.join(home, ".config"), **env}
    turns = []
    for turn, prompt in enumerate(PROMPTS, 1):
        recorder.set_label(f"{name}/{turn}")
        q0, h0 = cache_counters(server)
        rc, out, seconds = run_cli(turn_argv(name, argv, turn, prompt), env, home, timeout)
        q1, h1 = cache_counters(server)
        turns.append({"turn": turn, "prompt": prompt, "rc": rc, "seconds": seconds,
                      "requests": requests_of(log, f"{name}/{turn}"),
                      "prompt_tokens_looked_up": int(q1 - q0), "prefix_hit_tokens": int(h1 - h0),
                      "hit_share": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
                      "output_tail": out.strip()[-600:]})
        print(f"== {name} turn {turn}: rc={rc} in {seconds}s, looked up {int(q1 - q0)}, "
              f"hit {int(h1 - h0)}", flush=True)
    return {"client": name, "turns": turns,
            "completed": all(t["rc"] == 0 and t["requests"]
                             and all(r["status"] == 200 for r in t["requests"]) for t in turns)}


def requests_of(log: str, label: str) -> list[dict]:
    time.sleep(1.0)  # the proxy writes a stream's end once the client's connection closed
    with open(log) as f:
        entries = [json.loads(line) for line in f]
    return [{"method": e["method"], "path": e["path"], "status": e["status"]}
            for e in entries if e.get("client") == label and "path" in e
            and e["path"].startswith("/v1/")]


def client_version(bin_dir: str, name: str) -> str:
    out = subprocess.run([os.path.join(bin_dir, name), "--version"], capture_output=True,
                         text=True, timeout=60)
    return (out.stdout or out.stderr).strip().splitlines()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", nargs="+", choices=("claude", "codex"), default=["claude", "codex"])
    ap.add_argument("--prefix", default="/tmp/agent-clients", help="npm --prefix of the clients")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=RESULT)
    args = ap.parse_args()
    bin_dir = os.path.join(args.prefix, "node_modules", ".bin")
    command = readme_serve_command()
    port = free_port()
    argv = [*which_loomserve(), *command[1:], "--port", str(port)]
    log = os.path.join(tempfile.mkdtemp(prefix="two-turn-"), "requests.jsonl")
    open(log, "w").close()
    recorder = Recorder(log)
    with ServerProcess(argv, port, name="loomserve", startup_timeout=900) as srv:
        proxy_base, _ = start_proxy(srv.base_url, recorder)
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        clients = [run_turns(name, bin_dir, proxy_base, srv.base_url, model, recorder, log,
                             args.timeout) for name in args.clients]
        startup = next((ln for ln in srv.tail(20000).splitlines() if ln.startswith("loomserve:")),
                       "")
    path = write_json(args.out, {
        "server_command": shlex.join(command), "startup_line": re.sub(r"pid \d+", "pid N", startup),
        "client_versions": {n: client_version(bin_dir, n) for n in args.clients},
        "clients": clients})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
