"""The driver side: run plan, topology, supervision, status monitor, wandb. Only this layer (with the benches and entry points) imports actors/."""
