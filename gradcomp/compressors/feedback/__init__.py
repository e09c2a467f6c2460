"""Error feedback: remember what compression dropped and add it back to the next gradient.

A wrapper around any compressor (:class:`ErrorFeedback`, built by ``ef=true`` or ``ef=ef21`` in a
spec), composed of small pieces, each with one job:

============================  ====================================================================
:mod:`.options`               the spec's options (:class:`Feedback`), and what they change in the
                              wrapped compressor's record (``Capabilities``)
:mod:`.residual`              classic error feedback's memory: the residual e, ``c = g + e``,
                              ``e = c - contribution(c)`` (Seide et al. 2014; Karimireddy et al. 2019)
:mod:`.ef21`                  EF21's memory: this rank's estimate h and the global estimate G
                              (Richtarik et al., NeurIPS 2021)
:mod:`.momentum`              DGC's momentum correction: the velocity, Nesterov's form, masking
:mod:`.clipping`              DGC's local gradient clipping (Lin et al., ICLR 2018)
:mod:`.memory`                the protocol both memories implement, the step's context, keyed tensors
:mod:`.wrapper`               :class:`ErrorFeedback`: a step through the pieces, and their checkpoint
============================  ====================================================================

A step, for one key: the share ``g / p``, clipped, momentum-corrected, folded with the memory's
state into the compensated gradient ``c``; ``c`` compressed by the wrapped compressor; the memory
(and the velocity) settled from this rank's own final payload before it travels, kept only where
the step was finite (rule "one bad step"); the aggregate handed on (EF21: through G).
"""

from gradcomp.compressors.feedback.memory import FeedbackContext, Memory
from gradcomp.compressors.feedback.options import FEEDBACK_OPTIONS, Feedback, Variant
from gradcomp.compressors.feedback.wrapper import ErrorFeedback

__all__ = ["FEEDBACK_OPTIONS", "ErrorFeedback", "Feedback", "FeedbackContext", "Memory", "Variant"]
