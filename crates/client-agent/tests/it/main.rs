mod engine_io;
