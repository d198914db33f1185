"""jax_tpu_embed: large row-sharded embedding tables with sparse optimizers for JAX.

import jax_tpu_embed as jte
"""

from . import _multihost as multihost  # noqa: F401  (public: jte.multihost)
from . import _platforms
from . import backends as backends
from . import checkpoint as checkpoint
from . import compat as compat
from . import data as data
from . import flax as flax
from . import initializers as initializers
from . import nnx as nnx
from . import serving as serving
from ._config import DynamicTable as DynamicTable
from ._config import EmbeddingSpec as EmbeddingSpec
from ._config import FeatureConfig as FeatureConfig
from ._config import HostCached as HostCached
from ._config import TableConfig as TableConfig
from ._config_file import load_config as load_config
from ._config_file import load_spec as load_spec
from ._dynamic import DynamicRows as DynamicRows
from ._embedding import Embedding as Embedding
from ._embedding import EmbeddingState as EmbeddingState
from ._inflight import max_steps_in_flight as max_steps_in_flight
from ._inflight import set_max_steps_in_flight as set_max_steps_in_flight
from ._inputs import SplitIds as SplitIds
from ._inputs import Weighted as Weighted
from ._inputs import join_ids as join_ids
from ._inputs import pad_ragged as pad_ragged
from ._inputs import split_ids as split_ids
from ._optax import FromOptax as FromOptax
from ._optimizers import FTRL as FTRL
from ._optimizers import SGD as SGD
from ._optimizers import Adagrad as Adagrad
from ._optimizers import AdagradMomentum as AdagradMomentum
from ._optimizers import Adam as Adam
from ._optimizers import CustomOptimizer as CustomOptimizer
from ._optimizers import Momentum as Momentum
from ._optimizers import Optimizer as Optimizer
from ._optimizers import ProximalAdagrad as ProximalAdagrad
from ._optimizers import RMSProp as RMSProp
from ._optimizers import RowwiseAdagrad as RowwiseAdagrad
from ._train import TrainState as TrainState
from ._train import TrainStep as TrainStep
from ._train import make_train_step as make_train_step

__version__ = "0.1.0"

# Importing the modules above asks JAX for no device; this must come before anything does.
_platforms.skip_tpu_probe_without_chips()
