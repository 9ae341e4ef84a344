"""Screens of the app other than the main one."""
