"""The trial job: one process per rank, a JSON spec in and a JSON result out."""

import logging

# transformers imports torchao where it is installed; torchao then logs a warning for each of
# its CUDA kernel libraries a CPU build of torch cannot load, and torch one deprecation per enum
# torchao registers: every trial and every command would print them (autotune imports this
# package before transformers)
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
