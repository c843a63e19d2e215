"""JSON schema names, apart so the command line can name them in --help without loading the renderers."""

RESULTS_SCHEMA = "ernie-deploy/deploy/v3"
