"""The learning math, as pure functions of tensors: losses, advantages, micro-batching, token logprobs and the
update's statistics. Imports torch and the standard library only: no store, no config loading, no tracking."""
