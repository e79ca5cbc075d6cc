"""Runs ``own_loop.train`` on every rank and compares it with its reference (see README.md here)."""


def test_own_loop(gpuregress):
    # reference=: fail-fast can stop at the first step off the reference, and recording adds the noise envelope
    record = gpuregress.run("own_loop:train", config={"steps": 20}, reference="own-loop")
    gpuregress.check(record, name="own-loop")
