"""Images in the prefix cache's key (``scheduler/images.py``): key ids from the digest,
the keyed prompt the tree sees, the real ids the worker is sent; with the simulated
worker, a different image parts from the cache where its run begins and the same image
hits through it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from radixserve.protocol import ImageInput
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.images import KEY_IDS, check_images, key_ids, keyed_prompt, real_ids

PAD = 7


def image(seed: int, offset: int, tokens: int) -> ImageInput:
    digest = hashlib.sha256(str(seed).encode()).digest()
    ids = np.full(tokens, PAD, np.int32)
    return ImageInput(digest, offset, ids, PAD, [tokens, 4], np.zeros(4 * tokens, np.float32))


def test_key_ids_are_negative_and_differ_by_image():
    a, b = key_ids(image(1, 0, 4).digest), key_ids(image(2, 0, 4).digest)
    assert len(a) == KEY_IDS and (a < 0).all() and (b < 0).all()
    assert not (a == b).any()
    assert (key_ids(image(1, 0, 4).digest) == a).all()


def test_keyed_prompt_and_real_ids_round_trip():
    prompt = np.array([1, 2, PAD, PAD, PAD, PAD, PAD, 3, PAD, PAD, PAD, PAD, 4], np.int32)
    images = [image(1, 2, 5), image(2, 8, 4)]
    check_images(prompt, images)
    keyed = keyed_prompt(prompt, images)
    assert (keyed[:2] == [1, 2]).all() and keyed[7] == 3 and keyed[12] == 4
    assert (keyed[2:7] == np.resize(key_ids(images[0].digest), 5)).all()
    assert (keyed[8:12] == key_ids(images[1].digest)).all()
    assert (real_ids(keyed, 0, images) == prompt).all()
    assert (real_ids(keyed[5:10], 5, images) == prompt[5:10]).all()  # a chunk across both
    untouched = keyed[:2]
    assert real_ids(untouched, 0, images) is untouched  # no copy where no run is touched


@pytest.mark.parametrize(
    ("images", "why"),
    [
        ([image(1, 2, 5), image(2, 4, 4)], "overlap"),
        ([image(1, 10, 5)], "leave the prompt"),
        ([image(1, 1, 5)], "other tokens than its own"),
    ],
)
def test_bad_runs_are_refused(images, why):
    prompt = np.array([1, 2, PAD, PAD, PAD, PAD, PAD, 3, PAD, PAD, PAD, PAD, 4], np.int32)
    with pytest.raises(ValueError, match=why):
        check_images(prompt, images)


def test_the_tree_sees_the_image_and_the_worker_the_real_ids():
    from radixserve.scheduler.config import SchedulerConfig
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.scheduler.sim_worker import SimWorker

    cfg = SchedulerConfig(num_pages=64, page_size=1, eos_token_ids=(2,), max_context_len=256)
    sched = Scheduler(cfg)
    sim = SimWorker(64, 1, cfg.max_running_requests, 512)
    text = [5, 6, 9]
    prompt = np.array(text + [PAD] * 4 + [8], np.int32)
    sent = []

    def worker(step):
        sent.extend(np.asarray(r.input_ids).copy() for r in step.reqs)
        return sim.step(step)

    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    hits = {}
    for rid, seed in (("a", 1), ("b", 2), ("c", 1)):
        sched.add_request(rid, prompt, greedy, images=[image(seed, 3, 4)])
        while sched.has_work():
            for out in sched.step(worker):
                if out.finish_reason is not None:
                    hits[rid] = out.cached_tokens
    # Another image parts where its run begins; the same image hits through it.
    assert hits == {"a": 0, "b": len(text), "c": len(prompt) - 1}
    assert all((ids >= 0).all() for ids in sent)  # never a key id
    sched.check_idle()


def test_a_span_with_markers_between_placeholders_round_trips():
    """Idefics3's spans: tile markers between the placeholder runs are keyed with them
    and given back to the worker as they were."""
    span = np.array([60, PAD, PAD, 61, PAD, PAD, 62], np.int32)
    im = ImageInput(b"\x07" * 32, 1, span, PAD, [2, 4], np.zeros(8, np.float32))
    prompt = np.concatenate([[1], span, [2]]).astype(np.int32)
    check_images(prompt, [im])
    keyed = keyed_prompt(prompt, [im])
    assert (keyed[1:8] < 0).all() and keyed[0] == 1 and keyed[8] == 2
    assert (real_ids(keyed[3:6], 3, [im]) == prompt[3:6]).all()
