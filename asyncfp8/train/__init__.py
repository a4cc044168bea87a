"""One training step without sockets: the batch, log-probs, losses, loss scaling, the guard
and its rollback, the kept versions for pi_prox. Change the loss here."""
