"""Running a recipe: the CLI, the stage registry, preflight, `run`, and what every stage leaves
(atomic stage folders and manifests in `artifacts`, the verdict, the plots). Imports any room;
only the stages and fixtures import it."""
