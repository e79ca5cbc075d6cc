"""Runs ``own_loop.train`` on every rank and compares it with its reference (see README.md here)."""


def test_own_loop(gpuregress):
    record = gpuregress.run("own_loop:train", config={"steps": 20})
    gpuregress.check(record, name="own-loop")
