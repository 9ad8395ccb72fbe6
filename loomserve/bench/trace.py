"""Weka-format agentic traces: one JSON object per session (see AGENTX.md).

CONTRACT (the trace helper implements the parsing; replay and simulator code against this):

    TraceRequest: one model call.
        t: float            start time in seconds from the SESSION start (subagent times are
                            normalized to session time whatever convention the file used)
        in_tokens: int      input tokens ("in")
        out_tokens: int     output tokens ("out")
        hash_ids: tuple[int, ...]  one id per block_size-token block of the input, chained
        think_time: float   client-side gap before the request ("think_time", 0 if absent)
        api_time: float | None     original server time ("api_time"; None if absent)
        streaming: bool     type == "s"
        stop: str | None
        agent: str          "main" or the subagent's agent_id
    Subagent: a child agent's run, started after the parent turn before it.
        agent_id, subagent_type: str; t: float (session time); duration_ms: float | None
        requests: list[TraceRequest]  (time order)
    SubagentGroup: consecutive subagent entries between two parent turns (they run at once).
        subagents: list[Subagent]; after_index: int  (index into Session.main of the parent
        turn they follow; -1 if before the first); joined: bool (True when the next parent turn
        waits for the group: the group finished before that turn started in the recording)
    Session:
        id: str; path: str; block_size: int; models: list[str]
        main: list[TraceRequest]            the parent agent's requests, time order
        groups: list[SubagentGroup]         in order
        all_requests() -> list[TraceRequest]  main + subagents, sorted by t

    load_trace(path) -> Session        raises TraceError (names the file and the field/line)
    load_traces(paths) -> list[Session]  files and directories (*.json, sorted); all or nothing
    class TraceError(ValueError)
"""
