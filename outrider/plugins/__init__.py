"""Built-in plugins, registered explicitly so a source checkout works without installation."""

from .formats import deepspec, zlab
from .strategies import baseline, dflash, dspark, lookup
from .targets import dense

BUILTIN = [dense, deepspec, zlab, dspark, dflash, lookup, baseline]
