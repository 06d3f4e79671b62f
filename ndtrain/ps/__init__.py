"""Parameter-server training: S server ranks own the parameters (split by whole tensors) and the
optimizer; W worker ranks push gradients and pull parameters, sync, async or bounded-staleness
(ssp), point-to-point on the world group; each file's docstring gives its bytes and memory.

- messages.py: roles, the sharding of the parameters over the servers, the push/pull layout;
- server.py: server j (`ParameterServer`): consistency modes, staleness, the async rule, the guard;
- worker.py: worker w (`PSWorker`): forward/backward, push, pull, the straggler knob;
- engine.py: `PSEngine`, the same interface as `Engine`, so `Trainer.run` drives it.

Imports `config`, `errors`, `dist`, `parallel` (the gradient norm, parameter groups) and `engine`
(`StepResult`, `NonFiniteError`); `run/` (the trainer's engine kinds) and `bench/` import it.
"""
