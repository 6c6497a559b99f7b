"""Contract tests: one generic check run over every implementation of a concept (in the spirit of River's
``check_estimator``). Each module names the concept, the promises it checks, and the implementations it
checks them on; a new implementation joins by adding itself to the module's parametrisation."""
