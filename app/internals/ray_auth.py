"""Ray's private GCS client, asked once whether a cluster refuses this process's token (app.driver.cluster), behind
the same door as app.internals: checked against the installed Ray by tests/test_internals.py. A leaf: Ray imported
inside the function.

ray.init() retries the cluster's first answer 20 times, a second apart, whatever it is (ray/_private/node.py,
``NUM_REDIS_GET_RETRIES``), so a cluster that refuses the token is known only after 20 s; one call of the GCS client
answers in milliseconds. Ray publishes no such client.
"""

from __future__ import annotations

from typing import Optional


def cluster_refusal(address: str, wait_s: float = 3.0) -> Optional[BaseException]:
    """The error of one call to the cluster at ``address`` (a GCS address, host:port), or None when it answered,
    or did not answer within ``wait_s`` (the call goes on on a daemon thread; ray.init()'s own wait decides)."""
    import threading

    from ray._raylet import GcsClient

    answer: list[Optional[BaseException]] = []

    def call() -> None:
        try:
            answer.append(GcsClient(address=address).cluster_id and None)  # the cluster's first answer
        except Exception as e:  # the caller tells a refused token from the rest
            answer.append(e)

    thread = threading.Thread(target=call, name="cluster-token-check", daemon=True)
    thread.start()
    thread.join(wait_s)
    return answer[0] if answer else None
