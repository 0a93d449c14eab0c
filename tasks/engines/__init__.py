"""The engines: what samples completions (tasks/engines/sampling.py: hf, vLLM offline, vLLM server) and what
trains the policy (tasks/engines/training.py: torch, DeepSpeed). Each family is a Protocol with one factory;
the stages call the factory and never branch on the engine."""
