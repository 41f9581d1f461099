"""The RL loop of `grctl demo --rl` and examples/rl_loop.py: a synthetic recommendation task
(task.py), a policy-gradient trainer on transformers' Qwen3 (trainer.py), and the loop that
rolls out through a real server and pushes each step's weights back (loop.py)."""
