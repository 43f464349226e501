"""The terminal view (outrider/telemetry.py): the acceptance ribbon, the live view and the final
render, drawn from hand-made steps."""

from __future__ import annotations

import io

from rich.console import Console

from outrider import telemetry


def test_ribbon_and_live_view():
    assert telemetry.ribbon([(4, 0), (4, 2), (4, 4), (0, 0)]).plain == "▁▅█·"
    assert len(telemetry.ribbon([(4, 4)] * 50, width=10).plain) == 10

    class Step:
        def __init__(self, source, drafted, accepted):
            self.source, self.drafted, self.accepted = source, drafted, accepted

    class Chunk:
        def __init__(self, text, tokens, step):
            self.text, self.tokens, self.step = text, tokens, step

    view = telemetry.LiveView("dspark", 4)
    view.add(Chunk("Hello", [1], Step("prefill", [], 0)))
    view.add(Chunk(" world", [2, 3, 4], Step("draft", [2, 3, 9, 9], 2)))
    buffer = io.StringIO()
    Console(file=buffer, force_terminal=True, width=40, height=20).print(view)
    shown = buffer.getvalue()
    assert "Hello world" in shown and "4 tokens" in shown and "accept 3.00" in shown


def test_final_render_has_a_ribbon_legend():
    from outrider.core.events import Result, Round

    result = Result("hi", [1], [2, 3], rounds=[Round([5, 6], 1, [3], 0.1)], mode="dspark")
    buffer = io.StringIO()
    Console(file=buffer, width=100).print(telemetry.final_render(result))
    assert "· = no draft" in buffer.getvalue() and "more of the draft kept" in buffer.getvalue()
    empty = io.StringIO()
    Console(file=empty, width=100).print(telemetry.final_render(Result("hi", [1], [2])))
    assert "no draft" not in empty.getvalue()  # no ribbon, no legend
