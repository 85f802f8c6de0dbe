"""``sarp serve``: follow engines' KV events into an index on disk until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import time

from .subscriber import Source, Subscriber

log = logging.getLogger("sarp.serve")


def run(args: argparse.Namespace) -> int:
    import sarp

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sources = [s for spec in args.source
               for s in Source.expand(spec, args.dp_ranks)]
    stop = {"now": False}

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: stopping after the current batch", signum)
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with sarp.open(args.index, durability=args.durability) as index:
        log.info("index %s recovered from %s in %.1f ms; following %s", args.index,
                 index.recovered_from, 1e3 * index.recovery_s, ", ".join(s.key for s in sources))
        subscriber = Subscriber(index, sources,
                                replay_idle_timeout_s=args.replay_idle_timeout_s)
        last_snapshot = time.monotonic()
        last_report = time.monotonic()

        def should_stop() -> bool:
            nonlocal last_snapshot, last_report
            now = time.monotonic()
            if now - last_snapshot >= args.snapshot_every_s:
                index.snapshot()
                last_snapshot = now
            if now - last_report >= args.report_every_s:
                for name, s in subscriber.summary().items():
                    log.info("%s: seq %s, %d batches, %d gaps, %d replayed, %d restarts, "
                             "%d bad batches, %d bad frames, bad events %s", name,
                             s["last_seq"], s["batches"], s["gaps"], s["replayed"],
                             s["restarts"], s["bad_payloads"], s["bad_frames"],
                             dict(s["applied"]["bad_events"]) or "none")
                last_report = now
            return stop["now"]

        try:
            subscriber.run(should_stop)
        finally:
            subscriber.close()
        log.info("stopped; writing the snapshot")
    return 0
