"""The project as a whole: public API, docs, examples, layout, lint."""
