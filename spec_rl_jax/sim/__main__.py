from spec_rl_jax.sim.cli import main

main()
