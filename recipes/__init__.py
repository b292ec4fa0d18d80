"""The recipes shipped with the package, as YAML files beside this one: `hyco-convert recipes`
lists them, `hyco-convert run NAME` runs one (hyco/config/recipe.py: `packaged_recipes`, `find_recipe`)."""
