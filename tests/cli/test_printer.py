"""`llmfleet generate`'s output order, on the printer alone (no server)."""

from __future__ import annotations

import io

from llmfleet.cli.printer import CompletionPrinter


def test_printer_orders_out_of_order_streams():
    out, err = io.StringIO(), io.StringIO()
    p = CompletionPrinter(3, out, err)
    p.add(2, "c2", finished=True)
    p.add(1, "b1", finished=False)
    p.add(0, "a0", finished=False)
    assert out.getvalue() == "--- completion 0 ---\na0"
    p.add(1, "b2", finished=True)
    p.add(0, "a1", finished=True)
    p.close()
    assert out.getvalue() == (
        "--- completion 0 ---\na0a1\n--- completion 1 ---\nb1b2\n--- completion 2 ---\nc2\n"
    )
    assert err.getvalue() == ""
