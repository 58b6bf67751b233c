"""The shared KV store's stats as ``/metrics`` series (``http/metrics.py``)."""

from __future__ import annotations

from radixserve.http.metrics import Metrics

BASE = {"running": 0, "waiting": 0, "pages_free": 1, "pages_used": 0, "pages_cached": 0}


def _store(hit: int, miss: int, ms: int) -> dict:
    return {
        "store_hit_pages": hit,
        "store_miss_pages": miss,
        "store_read_bytes": 100 * hit,
        "store_written_bytes": 300,
        "store_reads": 2,
        "store_read_ms_total": ms,
        "store_read_ms_mean": ms / 2,
    }


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_store_counters_follow_the_stats():
    metrics = Metrics("m")
    stats = {**BASE, **dict.fromkeys(metrics._scheduler, 0)}
    metrics._apply({**stats, **_store(hit=4, miss=1, ms=30)})
    metrics._apply({**stats, **_store(hit=10, miss=3, ms=50)})
    assert _value(metrics, "radixserve:kv_store_pages_total", result="hit") == 10
    assert _value(metrics, "radixserve:kv_store_pages_total", result="miss") == 3
    assert _value(metrics, "radixserve:kv_store_bytes_total", op="read") == 1000
    assert _value(metrics, "radixserve:kv_store_bytes_total", op="written") == 300
    assert _value(metrics, "radixserve:kv_store_reads_total") == 2
    assert abs(_value(metrics, "radixserve:kv_store_read_seconds_total") - 0.05) < 1e-9
