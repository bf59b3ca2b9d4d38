"""Recorded traces replayed through the drafters, no model run: the replay
engine (``engine.py``), the drafters it drives (``drafters.py``), the
projection onto measured step costs (``projection.py``), and the commands
built on them: ``replay``, ``dp-replay``, ``device-report``, ``faults``,
``stream``."""
