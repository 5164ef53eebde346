"""Policy and reference models: token logprobs, the loss step, optimizer and schedule; batches by token budget."""
