"""Runs the queued calls of a cohort of states: each step, every state's text up to its next
model call, then all those calls as one batch (the gens in one request, the selects' scoring
in theirs), until nothing is queued."""

from __future__ import annotations

from radixserve.lang.calls import GenCall, ScoreCall
from radixserve.lang.gen import Gen
from radixserve.lang.select import Select
from radixserve.lang.state import Meta, ProgramState


def run_cohort(states: list[ProgramState]) -> None:
    while True:
        for st in states:
            st.apply_text_atoms()
        heads = [(st, st.pending[0]) for st in states if st.pending]
        if not heads:
            return
        gens = [(st, a) for st, a in heads if isinstance(a, Gen)]
        selects = [(st, a) for st, a in heads if isinstance(a, Select)]
        if gens:
            _run_gens(gens)
        if selects:
            _run_selects(selects)


def _run_gens(gens: list[tuple[ProgramState, Gen]]) -> None:
    calls = [GenCall(st.prompt(), g.sampling.over(st.defaults), st.chat_context()) for st, g in gens]
    streaming = any(st.streaming for st, _ in gens)

    def on_delta(i: int, text: str) -> None:
        st, g = gens[i]
        st.delta(g.name, text)

    results = gens[0][0].backend.generate(calls, on_delta if streaming else None)
    for (st, g), r in zip(gens, results):
        st.pending.pop(0)
        st.record(g.name, r.text, Meta([r.usage]))


def _run_selects(selects: list[tuple[ProgramState, Select]]) -> None:
    calls = [
        ScoreCall(st.prompt(), tuple(sel.choices), sel.method.unconditional_context, st.chat_context())
        for st, sel in selects
    ]
    results = selects[0][0].backend.score(calls)
    for (st, sel), r in zip(selects, results):
        best, scores = sel.method.decide(r.choices)
        st.pending.pop(0)
        st.record(sel.name, sel.choices[best], Meta(r.usage, scores))
