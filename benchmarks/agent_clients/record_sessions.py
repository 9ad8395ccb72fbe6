"""Record real agent-client sessions against loomserve: every request Claude Code, Codex and
opencode send over a 3-turn tool-using task, with what the server said about each one's cache
misses.

The server runs the command README.md gives agent clients (two_turn.readme_serve_command), with
`--log-level debug --log-format json`: its request log carries each request's `miss_causes`,
the core's `miss_detail` (the first differing token of `diverged`) and the text-side
`prompt_divergence`. Each client runs in a fresh HOME, in a folder holding greet.py, through the
recording proxy (proxy.py), for the turns in TURNS (read a file, edit it, run it), each turn a
new process continuing the last session (`claude -p --continue`, `codex exec resume --last`,
`opencode run --continue`); inside a turn the client's own agent loop sends as many requests as
its tool calls ask for. The built-in 135M model makes poor tool calls; the request sequence is
the point. The proxy caps each request's output at --max-output tokens (Codex asks for no limit,
and the small model may otherwise write to the end of the context on a CPU).

Output: benchmarks/results/agent_recordings/<client>.jsonl (recordings.py: compact, each
request whole, large values stored once) and the raw logs under --work. Then run
divergence.py over the recordings.

    npm install --prefix /tmp/agent-clients @anthropic-ai/claude-code @openai/codex opencode-ai
    python benchmarks/agent_clients/record_sessions.py [--clients claude codex opencode]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common.paths import RESULTS_DIR  # noqa: E402
from common.servers import ServerProcess, free_port, which_loomserve  # noqa: E402
from proxy import Recorder  # noqa: E402
from recordings import client_version, compact_session  # noqa: E402
from try_clients import CLIENTS, QUIET_ENV, run_cli, start_proxy  # noqa: E402
from two_turn import readme_serve_command  # noqa: E402

TURNS = ("Read greet.py and tell me what it prints.",
         "Edit greet.py so that it prints 'hello, world' instead.",
         "Run `python3 greet.py` and tell me its output.")
GREET = 'def main():\n    print("hello")\n\n\nif __name__ == "__main__":\n    main()\n'


def turn_argv(name: str, bin_dir: str, turn: int, prompt: str) -> list[str]:
    """Turn 1 starts a session; later turns continue the client's latest one."""
    more = turn > 1
    if name == "claude":
        return [os.path.join(bin_dir, "claude"), "-p", *(["--continue"] if more else []), prompt,
                "--max-turns", "3", "--allowedTools", "Read,Edit,Write,Bash"]
    if name == "codex":
        return [os.path.join(bin_dir, "codex"), "exec", "--skip-git-repo-check",
                *(["resume", "--last"] if more else []), prompt]
    return [os.path.join(bin_dir, "opencode"), "run", *(["--continue"] if more else []),
            "--auto", prompt]


def client_env(name: str, bin_dir: str, proxy_base: str, model: str, model_len: int,
               home: str) -> dict:
    """try_clients' configuration for the client, plus what lets it edit and run here."""
    _, env = CLIENTS[name](bin_dir, proxy_base, model, home, TURNS[0])
    if name == "opencode":  # the server's context: with less, opencode compacts in a loop
        with open(env["OPENCODE_CONFIG"]) as f:
            config = json.load(f)
        config["provider"]["loomserve"]["models"][model]["limit"]["context"] = model_len
        with open(env["OPENCODE_CONFIG"], "w") as f:
            json.dump(config, f, indent=2)
    if name == "codex":  # no approval prompts, no bubblewrap sandbox in this container
        path = os.path.join(home, ".codex", "config.toml")
        with open(path) as f:
            toml = f.read()
        with open(path, "w") as f:  # top-level keys: before the provider's table
            f.write('approval_policy = "never"\nsandbox_mode = "danger-full-access"\n' + toml)
    return {**os.environ, **QUIET_ENV, "HOME": home, "PWD": home,
            "XDG_CONFIG_HOME": os.path.join(home, ".config"), **env}


def run_session(name: str, bin_dir: str, proxy_base: str, model: dict, recorder: Recorder,
                timeout: float) -> list[dict]:
    home = tempfile.mkdtemp(prefix=f"rec-{name}-")
    with open(os.path.join(home, "greet.py"), "w") as f:
        f.write(GREET)
    env = client_env(name, bin_dir, proxy_base, model["id"], model["max_model_len"], home)
    turns = []
    for turn, prompt in enumerate(TURNS, 1):
        recorder.set_label(f"{name}/{turn}")
        rc, out, seconds = run_cli(turn_argv(name, bin_dir, turn, prompt), env, home, timeout)
        turns.append({"turn": turn, "prompt": prompt, "rc": rc, "seconds": seconds,
                      "output_tail": out.strip()[-400:]})
        print(f"== {name} turn {turn}: rc={rc} in {seconds}s", flush=True)
    time.sleep(1.0)  # the proxy writes a stream's end once the client's connection closed
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    ap.add_argument("--prefix", default="/tmp/agent-clients", help="npm --prefix of the clients")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per turn")
    ap.add_argument("--max-output", type=int, default=256,
                    help="output tokens per request at most (the proxy caps what clients ask)")
    ap.add_argument("--work", default=None, help="folder for the raw logs (default: a temp one)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "agent_recordings"))
    args = ap.parse_args()
    bin_dir = os.path.join(args.prefix, "node_modules", ".bin")
    work = args.work or tempfile.mkdtemp(prefix="agent-rec-")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "requests.jsonl")
    open(log, "w").close()
    recorder = Recorder(log)
    command = readme_serve_command()
    port = free_port()
    argv = [*which_loomserve(), *command[1:], "--port", str(port), "--log-level", "debug",
            "--log-format", "json"]
    sessions = {}
    with ServerProcess(argv, port, name="loomserve", startup_timeout=900) as srv:
        proxy_base, _ = start_proxy(srv.base_url, recorder, args.max_output)
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]
        for name in args.clients:
            sessions[name] = run_session(name, bin_dir, proxy_base, model, recorder, args.timeout)
        server_log = os.path.join(work, "server.log")
        with open(srv.log.name, "rb") as src, open(server_log, "wb") as dst:
            dst.write(src.read())
    os.makedirs(args.out, exist_ok=True)
    for name, turns in sessions.items():
        meta = {"client": name, "version": client_version(bin_dir, name),
                "server_command": command, "max_output": args.max_output, "turns": turns}
        path = compact_session(log, server_log, name, meta, os.path.join(args.out, f"{name}.jsonl"))
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    with open(os.path.join(work, "sessions.json"), "w") as f:
        json.dump(sessions, f, indent=1)


if __name__ == "__main__":
    main()
