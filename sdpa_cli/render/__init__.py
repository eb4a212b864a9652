"""Rich renderables only: one theme, tables, panels and plots for every command."""
