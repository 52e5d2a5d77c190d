"""Functions run at once, one thread each (tensor-parallel ranks as threads in tests).

    results = in_threads([lambda: rank(0), lambda: rank(1)])

Returns each function's result in order; re-raises the first exception any of them raised,
after every thread ended.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence


def in_threads(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
