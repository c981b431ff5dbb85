"""The open accumulation window, by concern (the optimizer holds one Window; everything else
reaches it through the optimizer):

- ``state.py``: ``Window``: buffers, live set, counters, weight total and band, found-inf; the
  verbs that take gradients in;
- ``table.py``: plain mode's step table (one extension call per micro-batch) and the update
  plan (the update's per-group lists, kept between closes);
- ``close.py``: the close (sync -> found-inf -> clip -> update) and the window's listeners.
"""
from .close import WindowListeners, tell_transaction, window_listeners
from .state import Window
from .table import StepTable, UpdatePlan, take_with_table

__all__ = ["StepTable", "UpdatePlan", "Window", "WindowListeners", "take_with_table", "tell_transaction",
           "window_listeners"]
