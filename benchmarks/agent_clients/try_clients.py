"""Run the real agent CLIs (Claude Code, Codex, opencode) against a running `loomserve serve`,
as a user would, through a recording proxy (proxy.py): which requests each client sent, the
status codes, and the error bodies of what failed.

Install the clients first (no global install; their postinstall scripts are not needed):
    npm install --prefix /tmp/agent-clients @anthropic-ai/claude-code @openai/codex opencode-ai
Then, with a server on :8000:
    python benchmarks/agent_clients/try_clients.py --url http://127.0.0.1:8000 \
        [--clients claude codex opencode] [--prompt "say hi"]

Each client runs in its own temp HOME (no user config, no telemetry, no auto-update) with a
time limit. Output: per client its exit code, the end of its output, and the proxy's request
lines; the full request log is --log (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proxy import Recorder, build_proxy  # noqa: E402

QUIET_ENV = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DO_NOT_TRACK": "1",
             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_ERROR_REPORTING": "1",
             "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
             "NO_COLOR": "1"}


def claude(bin_dir: str, base: str, model: str, home: str, prompt: str) -> tuple[list, dict]:
    env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": "loomserve",
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
           "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
           # a CPU prefills Claude Code's 20K-token first prompt in minutes: past its 10-minute
           # default the client would give up and resend it
           "API_TIMEOUT_MS": "3600000"}
    return [os.path.join(bin_dir, "claude"), "-p", prompt, "--max-turns", "2"], env


def codex(bin_dir: str, base: str, model: str, home: str, prompt: str) -> tuple[list, dict]:
    codex_home = os.path.join(home, ".codex")
    os.makedirs(codex_home, exist_ok=True)
    with open(os.path.join(codex_home, "config.toml"), "w") as f:
        f.write(f'model = "{model}"\nmodel_provider = "loomserve"\n'
                f'model_reasoning_effort = "low"\n\n'
                f'[model_providers.loomserve]\nname = "loomserve"\nbase_url = "{base}/v1"\n'
                f'wire_api = "responses"\nenv_key = "LOOMSERVE_API_KEY"\n')
    env = {"CODEX_HOME": codex_home, "LOOMSERVE_API_KEY": "loomserve"}
    return [os.path.join(bin_dir, "codex"), "exec", "--skip-git-repo-check", prompt], env


def opencode(bin_dir: str, base: str, model: str, home: str, prompt: str) -> tuple[list, dict]:
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"loomserve": {
                  "npm": "@ai-sdk/openai-compatible", "name": "loomserve",
                  "options": {"baseURL": f"{base}/v1", "apiKey": "loomserve"},
                  "models": {model: {"name": model, "tool_call": True,
                                     "limit": {"context": 32768, "output": 256}}}}},
              "model": f"loomserve/{model}", "autoupdate": False, "share": "disabled"}
    path = os.path.join(home, "opencode.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return [os.path.join(bin_dir, "opencode"), "run", prompt], {"OPENCODE_CONFIG": path}


CLIENTS = {"claude": claude, "codex": codex, "opencode": opencode}


def start_proxy(upstream: str, recorder: Recorder, max_output: int | None = None
                ) -> tuple[str, object]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(build_proxy(upstream, recorder, max_output),
                                        log_level="warning", lifespan="off"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not srv.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv


def run_client(name: str, args, base: str, model: str) -> dict:
    home = tempfile.mkdtemp(prefix=f"agent-{name}-")
    argv, env = CLIENTS[name](os.path.join(args.prefix, "node_modules", ".bin"), base, model,
                              home, args.prompt)
    # PWD too: opencode takes its project folder from it, not from the process's cwd
    argv += shlex.split(args.extra_args)
    env = {**os.environ, **QUIET_ENV, "HOME": home, "PWD": home,
           "XDG_CONFIG_HOME": os.path.join(home, ".config"), **env,
           **dict(kv.split("=", 1) for kv in args.env)}
    rc, out, seconds = run_cli(argv, env, home, args.timeout)
    return {"client": name, "rc": rc, "seconds": seconds, "output_tail": out[-3000:],
            "home": home}


def run_cli(argv: list, env: dict, cwd: str, timeout: float) -> tuple[int | str, str, float]:
    """One run of a client CLI, no stdin: (exit code or "timeout", stdout + stderr, seconds)."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", "".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                                     for x in (e.stdout or "", e.stderr or ""))
    return rc, out, round(time.monotonic() - t0, 1)


def summarize(log: str, name: str) -> list[str]:
    time.sleep(1.0)  # the proxy writes a stream's end once the client's connection closed
    with open(log) as f:
        entries = [json.loads(line) for line in f]
    ends = {e["stream_end_of"]: e["stream_tail"] for e in entries if "stream_end_of" in e}
    lines = []
    for n, entry in enumerate(entries, 1):
        if entry["client"] != name or "path" not in entry:
            continue
        body = entry.get("request") or {}
        keys = sorted(body) if isinstance(body, dict) else []
        line = f"  {entry['method']} {entry['path']} -> {entry['status']}  fields={keys}"
        if "response" in entry:
            line += f"\n    error: {json.dumps(entry['response'])[:600]}"
        if n in ends:
            line += f"\n    stream end: {ends[n][-400:]}"
        lines.append(line)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    p.add_argument("--prefix", default="/tmp/agent-clients", help="npm --prefix of the clients")
    p.add_argument("--prompt", default="say hi")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--log", default="/tmp/agent-clients/requests.jsonl")
    p.add_argument("--extra-args", default="", help="more arguments for the client(s)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="more environment for the client(s)")
    args = p.parse_args()
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    open(args.log, "w").close()  # this run's requests only
    recorder = Recorder(args.log)
    base, _ = start_proxy(args.url, recorder)
    for name in args.clients:
        recorder.set_label(name)
        res = run_client(name, args, base, model)
        print(f"== {name}: rc={res['rc']} in {res['seconds']} s (home {res['home']})")
        print("\n".join(summarize(args.log, name)) or "  (no requests reached the server)")
        print("  output: " + res["output_tail"].strip().replace("\n", "\n    ")[-1500:])


if __name__ == "__main__":
    main()
