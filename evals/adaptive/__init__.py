"""Adaptive self-consistency replayed: stop rules on recorded votes
(``stop-rules``, with its leave-one-set-out choice of the default rule),
waves + stopping with drafting (``waves``), and wave schedules simulated on
a math run's samples (``waves-sim``)."""
