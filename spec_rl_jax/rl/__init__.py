"""The RL learner: rewards (host-side Python), advantages, losses and the loop."""
