"""Performance simulator: projected RL step times (AR vs speculative rollouts, sync vs
async) from a roofline of each call, a discrete-event simulation of continuous batching
and a pipeline model of the step. ``python -m spec_rl_jax.sim --help``; calibration:
``python -m spec_rl_jax.sim.calibrate``.

Modules: `models` (shapes), `hardware` (chips and pods), `cost` (per-call, learner,
transfer, memory), `acceptance` (a_i, E(k), the choice of k), `rollout` (the event
simulation), `pipeline` (sync/async steps), `cli` and `report` (the command), `calibrate`.
"""
