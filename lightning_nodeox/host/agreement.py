"""The hash a host reports once its run has completed: of the weights it holds, never just the run's.

Every host ends the final round on the run's final model, bit for bit. Lightning's ``StochasticWeightAveraging``
and ``WeightAveraging`` (``EMAWeightAveraging``) copy their own average into the model in ``on_train_end``: with
one of them the final round closes in the strategy's ``on_train_end``, after the callbacks' (even when the last
batch fell on a round boundary), so it carries every host's average and the hosts still end on one model; a host
whose training the run's end stopped (another host's ended first) drops its average and holds the run's final model
(:meth:`~lightning_nodeox.host.session.HostSession.end`). Any other callback or the LightningModule may still write
into the model in ``on_train_end`` or ``on_fit_end``, and then the hosts hold different weights.

So once the run has completed, the host hashes the tensors it holds (after ``on_train_end``, and again at
``teardown``, when ``fit`` returns): that hash is what ``NodeoxStrategy.model_hash`` reports. When it differs from
the run's final model, a warning says so, with both hashes, the callbacks that could have done it, and what to do."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module

from ..core.hashing import model_hash
from ..core.pool import WorkerPool
from .tensors import shared_tensors

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    WeightAveraging = StochasticWeightAveraging

AVERAGING = (StochasticWeightAveraging, WeightAveraging)  # write their average into the model in on_train_end
AFTER_FINAL_ROUND = ("on_train_batch_end", "on_train_epoch_end", "on_validation_end", "on_train_end", "on_fit_end")
_OWN_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_nodeox.")  # callbacks known not to change weights


def averages_weights(trainer: Trainer) -> bool:
    """Whether a callback writes its own average into the model in ``on_train_end`` (weight averaging): the final
    round then closes in the strategy's ``on_train_end``, after the callbacks', so that it carries every host's
    average and the hosts end on one model."""
    return any(isinstance(c, AVERAGING) for c in trainer.callbacks)


def suspects(trainer: Trainer) -> list[str]:
    """The callbacks (and the LightningModule) that could have changed the weights after the final round: those
    outside Lightning that override a hook run after it (the weight-averaging ones write before it)."""
    found = []
    for callback in trainer.callbacks:
        kind = type(callback)
        if not kind.__module__.startswith(_OWN_PACKAGES):
            hooks = [h for h in AFTER_FINAL_ROUND if getattr(kind, h, None) is not getattr(Callback, h)]
            if hooks:
                found.append(f"{kind.__name__} ({', '.join(hooks)})")
    module = trainer.lightning_module
    hooks = [h for h in ("on_train_end", "on_fit_end") if getattr(type(module), h) is not getattr(LightningModule, h)]
    if hooks:
        found.append(f"{type(module).__name__} ({', '.join(hooks)})")
    return found


class FinalHash:
    """The hash of the weights a host holds after its run completed, checked against the run's final model."""

    def __init__(self) -> None:
        self.value: str | None = None
        self._reported: set[str] = set()

    def check(self, trainer: Trainer, host: str, run_hash: str, pool: WorkerPool | None = None) -> str:
        """Hash the weights held now; warn (once per hash) when they are not the run's final model ``run_hash``."""
        return self.check_module(trainer.lightning_module, host, run_hash, pool, lambda: suspects(trainer))

    def check_module(self, module: Module, host: str, run_hash: str, pool: WorkerPool | None,
                     found: Callable[[], list[str]], frozen: Callable[[], list[str]] = list) -> str:
        """:meth:`check` for a module outside a Trainer; ``found``: who could have changed its weights; ``frozen``:
        the frozen parameters that are not the run's final model's."""
        held = model_hash(shared_tensors(module), pool)
        self.value = held
        if held != run_hash and held not in self._reported:
            self._reported.add(held)
            rank_zero_warn(disagreement(host, held, run_hash, found(), frozen()))
        return held


def disagreement(host: str, held: str, run_hash: str, found: list[str], frozen: list[str] | None = None) -> str:
    """The warning: which weights this host holds, which model the run ended on, who could have changed them,
    and what to do; ``frozen``: frozen parameters that differ from the run's final model (rounds never sent them)."""
    if frozen:
        return (
            f"NodeoxStrategy: host {host} ends fit holding model {held}, NOT the run's final model {run_hash}: "
            f"{len(frozen)} frozen parameter(s) (requires_grad=False) differ from it, e.g. {frozen[0]!r}. Rounds do "
            "not exchange frozen parameters, so one that code writes during training (an EMA teacher) stays each "
            "host's own. Keep such a tensor as a buffer (self.register_buffer(...)) to have it averaged every round "
            "(docs/lightning.md, \"Frozen layers and BackboneFinetuning\").")
    culprits = "; ".join(found) if found else "a callback or the LightningModule (none could be named)"
    return (
        f"NodeoxStrategy: host {host} ends fit holding model {held}, NOT the run's final model {run_hash} that every "
        f"host agreed on: the weights were changed after the final round, by {culprits}. The hosts no longer hold "
        f"the same weights; NodeoxStrategy.model_hash on this host reports {held}, and each host reports its own. "
        "To end every host on one model, keep the callback from writing into the model at the end of training "
        "(a subclass of Lightning's WeightAveraging writes before the final round, which then carries it), or "
        f"evaluate and save the run's final model {run_hash} (the weights of a host without such a "
        "callback) instead of this host's weights.")
