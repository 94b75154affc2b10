"""The words that some supported database reserves, and so refuses as a bare table name
(``validation.check_table_name``): PostgreSQL's, MariaDB's, MySQL's and SQLite's, as
SQLAlchemy's dialects list them. Kept here rather than read from the dialects, whose packages
import every driver's dialect with them, which each process on SQLite or MariaDB that opens a
Locker on a table of its own name would otherwise load at its start.
``tests/test_inputs_and_errors.py`` checks that every word the installed SQLAlchemy lists is
here.
"""

# One string, split: a literal of one word a line would be 356 lines.
RESERVED_WORDS = frozenset(
    """
accessible add admin after all alter analyse analyze and any array as asc asensitive asymmetric
attach authorization autoincrement before begin between bigint binary blob body both by call
cascade case cast change char character check collate column commit condition conflict
constraint continue convert create cross cube cume_dist current_catalog current_date
current_role current_schema current_time current_timestamp current_user cursor database
databases day_hour day_microsecond day_minute day_second dec decimal declare default deferrable
deferred delayed delete dense_rank desc describe detach deterministic distinct distinctrow div
do do_domain_ids double drop dual each else elseif elsif empty enclosed end escape escaped
except exclusive exists exit explain fail false fetch first_value float float4 float8 for force
foreign freeze from full fulltext function general generated get get_master_public_key glob
goto grant group grouping groups having high_priority history hour_microsecond hour_minute
hour_second if ignore ignore_domain_ids ignore_server_ids ilike immediate in index indexed
infile initially inner inout insensitive insert instead int int1 int2 int3 int4 int8 integer
intersect interval into io_after_gtids io_before_gtids is isnull iterate join json_table key
keys kill lag last_value lateral lead leading leave left like limit linear lines load localtime
localtimestamp lock long longblob longtext loop low_priority master_bind
master_heartbeat_period master_ssl_verify_server_cert match maxvalue mediumblob mediumint
mediumtext member middleint minute_microsecond minute_second mod modifies natural new
no_write_to_binlog not notnull nth_value ntile null numeric of off offset old on only optimize
optimizer_costs option optionally or order others out outer outfile over overlaps package
page_checksum parallel parse_gcol_expr parse_vcol_expr partition percent_rank period persist
persist_only placing plan position pragma precision primary procedure purge qualify query raise
range rank read read_write reads real recursive ref_system_id references regexp reindex release
rename repeat replace require resignal restrict return returning revoke right rlike role
rollback row row_number rows rowtype schema schemas second_microsecond select sensitive
separator session_user set show signal similar slow smallint some spatial specific sql
sql_after_gtids sql_before_gtids sql_big_result sql_calc_found_rows sql_small_result
sqlexception sqlstate sqlwarning ssl starting stats_auto_recalc stats_persistent
stats_sample_pages stored straight_join symmetric system system_time table temp temporary
terminated then tinyblob tinyint tinytext to trailing transaction trigger true undo union
unique unlock unsigned update usage use user using utc_date utc_time utc_timestamp vacuum
values varbinary varchar varcharacter variadic varying verbose versioning view virtual when
where while window with without write xor year_month zerofill
""".split()  # noqa: SIM905
)
