"""The open accumulation window, by concern (the optimizer holds one Window; everything else
reaches it through the optimizer):

- ``state.py``: ``Window``: buffers, live set, counters, weight total and band, found-inf; the
  verbs that take gradients in;
- ``plain.py``: plain mode's micro-batches: the spec (``add_micro_batch``, a Python loop) and
  its fast path (``take_with_table``: one extension call);
- ``table.py``: each parameter's route (``route``: what the fast paths may do with its
  gradients, decided once per layout epoch), the step table (csrc/step_table.cpp) and the update
  plan (the update's per-group lists, kept between closes);
- ``close.py``: the close (sync -> found-inf -> clip -> update) and the window's listeners.
"""
from .close import WindowListeners, tell_transaction
from .state import Window
from .plain import add_micro_batch, take_with_table
from .table import Route, StepTable, UpdatePlan, route

__all__ = ["Route", "StepTable", "UpdatePlan", "Window", "WindowListeners", "add_micro_batch", "route",
           "take_with_table", "tell_transaction"]
