"""Built-in plugins, registered explicitly so a source checkout works without installation."""

from .formats import deepspec, liquid_dspark, specforge_dspark, speculators, zlab
from .formats import dflash2 as dflash2_format
from .formats import eagle3 as eagle3_format
from .kernels import cuda_rows
from .strategies import baseline, dflash, dflash2, draft_model, dspark, eagle3, lookup
from .targets import dense, fallback, hybrid, looped, sliding

BUILTIN = [dense, hybrid, sliding, looped, fallback, deepspec, zlab, dspark, dflash, lookup]
BUILTIN += [baseline]
BUILTIN += [draft_model]
BUILTIN += [speculators, specforge_dspark, liquid_dspark]
BUILTIN += [dflash2_format, dflash2]
BUILTIN += [eagle3_format, eagle3]
BUILTIN += [cuda_rows]
